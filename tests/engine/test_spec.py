"""engine/spec: drafters, acceptance, adaptive k and the loop guard, on the CPU with a toy model."""

from __future__ import annotations

import numpy as np
import pytest

from engine import sampler
from engine.backend import SampleRequest
from engine.sampling import SamplingParams
from engine.spec.adaptive import AdaptiveK
from engine.spec.drafters import NgramIndex, PredictionDrafter, PromptLookup
from engine.spec.loop_guard import LoopGuard
from engine.spec.verify import accept_sampled, accept_with_distribution, row_requests

# --- drafters ------------------------------------------------------------------------------


def brute_continuation(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """Where the longest n-gram ending ``tokens`` last occurred earlier, continuing (a full search)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrences ending before the last token
            if tokens[end - n : end] == suffix:
                return end
    return None


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_index_finds_what_a_full_search_finds(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, size=300).tolist()  # a small alphabet: many repeats
    idx = NgramIndex(2, 4)
    for i, t in enumerate(tokens, 1):
        idx.extend([t])
        assert idx.continuation(tokens[:i][-4:]) == brute_continuation(tokens[:i], 2, 4), i


def test_prompt_lookup_proposes_what_followed_the_last_match():
    d = PromptLookup(min_n=2, max_n=3)
    d.commit([1, 2, 3, 4, 5, 9, 9, 2, 3])
    assert d.propose(3) == [4, 5, 9]  # "2 3" occurred at 1..2, then 4 5 9
    assert d.propose(0) == []
    d.commit([7])
    assert d.propose(4) == []  # "3 7" never occurred before


def test_prompt_lookup_prefers_the_longer_ngram():
    d = PromptLookup(min_n=1, max_n=3)
    d.commit([5, 1, 2, 8, 0, 2, 6, 0, 1, 2])  # "1 2" -> 8 (n=2) beats "2" -> 6 (n=1, more recent)
    assert d.propose(1) == [8]


def test_prediction_drafter_follows_diverges_and_refinds():
    pred = [10, 11, 12, 13, 14, 15, 16, 17]
    d = PredictionDrafter(pred, prompt_len=3)
    d.commit([1, 2, 3])  # the prompt is not followed
    assert d.propose(3) == [10, 11, 12]
    d.commit([10, 11])
    assert d.propose(2) == [12, 13]
    d.commit([99])  # the output leaves the prediction
    assert d.propose(2) == []
    d.commit([14, 15])  # ... and rejoins it: "14 15" is found, 16 follows
    assert d.propose(3) == [16, 17]
    d.commit([16, 17])
    assert d.propose(3) == []  # the prediction is used up


# --- acceptance ----------------------------------------------------------------------------


def test_accept_sampled_keeps_the_agreeing_prefix_and_the_first_disagreement():
    assert accept_sampled([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_sampled([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_sampled([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept_sampled([], [3]) == [3]
    with pytest.raises(ValueError):
        accept_sampled([1, 2], [1, 2])


class ToyModel:
    """Logits from the last two tokens by a fixed random table: a model whose output repeats."""

    def __init__(self, vocab: int = 12, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((vocab, vocab, vocab)) * 3).astype(np.float32)

    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.table[tokens[-2], tokens[-1]]


def generate_plain(model: ToyModel, prompt: list[int], n: int, req: SampleRequest) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(n):
        r = SampleRequest(req.params, req.seed, prompt, list(out))
        t, _ = sampler.sample_row(model.logits(toks), r, len(toks))
        toks.append(t)
        out.append(t)
    return out


def generate_speculative(model: ToyModel, prompt: list[int], n: int, req: SampleRequest, k: int):
    """Verify rounds driven the way the engine does: k drafts, k + 1 rows, accept_sampled."""
    toks, out, rounds = list(prompt), [], 0
    drafter = PromptLookup(1, 3)
    drafter.commit(prompt)
    while len(out) < n:
        drafts = drafter.propose(k)
        base = SampleRequest(req.params, req.seed, prompt, list(out))
        sampled = []
        for j, r in enumerate(row_requests(base, drafts)):
            ctx = toks + drafts[:j]
            sampled.append(sampler.sample_row(model.logits(ctx), r, len(ctx))[0])
        kept = accept_sampled(drafts, sampled)[: n - len(out)]
        toks += kept
        out += kept
        drafter.commit(kept)
        rounds += 1
    return out, rounds


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0,
     frequency_penalty=0.5, repetition_penalty=1.2)],
)  # fmt: skip
def test_speculation_commits_exactly_the_tokens_speculation_off_would(params):
    model = ToyModel()
    for seed in range(4):
        req = SampleRequest(params=params, seed=seed)
        prompt = [1, 2, 3, 1, 2]
        plain = generate_plain(model, prompt, 120, req)
        spec, rounds = generate_speculative(model, prompt, 120, req, k=4)
        assert spec == plain
        if params.temperature == 0:
            assert rounds < 120  # greedy loops on a toy model: lookup drafts must land


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_the_standard_rule_emits_the_target_distribution():
    """Chi-square of the first emitted token over many seeds against p (df = 7; 0.1% critical 24.3)."""
    rng = np.random.default_rng(1)
    vocab = 8
    p = rng.dirichlet(np.ones(vocab), size=3)
    q = rng.dirichlet(np.ones(vocab) * 0.5, size=2)
    draws = 20000
    first = np.zeros(vocab)
    second_given_accept = np.zeros(vocab)
    for seed in range(draws):
        d0 = int(np.searchsorted(np.cumsum(q[0]), sampler.uniform(seed, 0, 7), side="right").clip(0, vocab - 1))
        d1 = int(np.searchsorted(np.cumsum(q[1]), sampler.uniform(seed, 1, 7), side="right").clip(0, vocab - 1))
        out = accept_with_distribution(p, q, [d0, d1], seed, 100)
        first[out[0]] += 1
        if len(out) >= 2 and out[0] == d0:
            second_given_accept[out[1]] += 1
    assert chi_square(first, p[0]) < 24.3
    # The row after an accepted draft is distributed as the target's next row.
    assert chi_square(second_given_accept, p[1]) < 24.3


def test_the_chi_square_check_can_fail():
    """The statistic above rejects a distribution that is not the target's."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(8))
    wrong = np.roll(p, 1)
    counts = rng.multinomial(20000, wrong).astype(float)
    assert chi_square(counts, p) > 24.3


# --- adaptive k ----------------------------------------------------------------------------


def test_k_turns_itself_off_for_a_lane_whose_drafts_fail_and_probes_back():
    a = AdaptiveK(max_k=8, probe_every=4)
    ks = []
    for _ in range(30):
        k = a.next_k(available=8)
        ks.append(k)
        a.update(k, 0)
    assert ks[0] >= 1 and 0 in ks
    probes = [k for k in ks[ks.index(0) :] if k]
    assert probes and all(k == 1 for k in probes)  # off, with one-draft probes
    for _ in range(12):
        k = a.next_k(available=8)
        a.update(k, k)  # the text turned repetitive: every draft lands
    assert a.next_k(available=8) >= 4
    assert a.next_k(available=2) <= 2  # never more than the drafter offers


# --- loop guard ----------------------------------------------------------------------------


def test_the_guard_fires_when_the_count_th_copy_completes():
    rng = np.random.default_rng(3)
    head = rng.integers(100, 200, size=40).tolist()
    span = rng.integers(0, 50, size=12).tolist()
    g = LoopGuard(min_span=8, max_span=64, count=3)
    stream = head + span * 3
    fired = [(i, g.push(t)) for i, t in enumerate(stream)]
    assert [(i, s) for i, s in fired if s is not None] == [(len(stream) - 1, 12)]
    assert g.rewind_to(12) == len(head) + len(span)  # keeps the head and the first copy


def test_the_guard_ignores_two_copies_and_counts_a_short_period_as_its_multiple():
    g = LoopGuard(min_span=8, max_span=64, count=3)
    hits = [(i, g.push(t)) for i, t in enumerate([1, 2] * 30)]
    # A period-2 loop is a period-8 loop too: it fires once 3 x 8 tokens have repeated.
    assert next((i, s) for i, s in hits if s is not None) == (23, 8)
    g2 = LoopGuard(min_span=4, max_span=64, count=3)
    assert all(g2.push(t) is None for t in [1, 2, 3, 4, 5] * 2 + [9])


def test_truncate_forgets_the_loop():
    g = LoopGuard(min_span=4, max_span=32, count=3)
    span = [1, 2, 3, 4, 5]
    hit = None
    for t in [9] + span * 3:
        hit = g.push(t) or hit
    assert hit == 5
    keep = g.rewind_to(5)
    assert g.tokens[:keep] == [9] + span
    g.truncate(keep)
    assert all(g.push(t) is None for t in [42, 43])


def test_a_lost_prediction_falls_back_to_prompt_lookup():
    d = PredictionDrafter([50, 51, 52], prompt_len=4, fallback=PromptLookup(2, 3))
    d.commit([1, 2, 3, 4])
    assert d.propose(2) == [50, 51] and d.source == "prediction"
    d.commit([1, 2])  # not the prediction: lost; "1 2" was followed by 3 in the prompt
    assert d.propose(2) == [3, 4] and d.source == "prompt_lookup"
    d.commit([50, 51])  # back on the prediction
    assert d.propose(2) == [52] and d.source == "prediction"
