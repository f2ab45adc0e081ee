"""Sampler: seeded draws independent of the batch, masks, penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import SampleRequest
from engine.sampler import apply_penalties, log_softmax, process_logits, sample_row, sample_rows
from engine.sampling import MIN_TEMPERATURE, SamplingParams

VOCAB = 1000


def make_logits(n: int, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * 2).astype(np.float32)


def req(seed: int = 1, want_logprobs: bool = False, num_logprobs: int = 0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), seed=seed, want_logprobs=want_logprobs, num_logprobs=num_logprobs)


def test_seeded_draw_independent_of_batch_composition():
    logits = make_logits(8)
    target = req(seed=1234, temperature=0.9, top_p=0.95)
    alone, alone_lp = sample_rows(logits[3:4], [target], [17])
    others = [req(seed=s, temperature=1.3, top_k=5) for s in range(8)]
    others[3] = target
    batch, batch_lp = sample_rows(logits, others, [5, 6, 7, 17, 9, 10, 11, 12])
    assert batch[3] == alone[0]
    # And the same row lands on the same token at any batch index.
    shuffled = np.roll(logits, 2, axis=0)
    reqs = others[-2:] + others[:-2]
    toks, _ = sample_rows(shuffled, reqs, [11, 12, 5, 6, 7, 17, 9, 10])
    assert toks[5] == alone[0]


def test_draw_depends_on_seed_and_position():
    logits = np.zeros((1, VOCAB), np.float32)  # uniform: different keys almost surely differ
    a = [sample_rows(logits, [req(seed=s)], [p])[0][0] for s in range(5) for p in range(5)]
    assert len(set(a)) > 15
    again = [sample_rows(logits, [req(seed=s)], [p])[0][0] for s in range(5) for p in range(5)]
    assert a == again


def test_draws_follow_distribution():
    x = np.full((1, 4), -np.inf, np.float32)
    x[0, :3] = np.log([0.2, 0.3, 0.5])
    counts = np.zeros(4)
    for s in range(3000):
        counts[sample_rows(x, [req(seed=s)], [0])[0][0]] += 1
    assert counts[3] == 0
    np.testing.assert_allclose(counts[:3] / counts.sum(), [0.2, 0.3, 0.5], atol=0.03)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.7, top_k=1)])
def test_greedy_is_argmax(params):
    logits = make_logits(4)
    toks, _ = sample_rows(logits, [req(seed=s, **params) for s in range(4)], [0, 1, 2, 3])
    assert toks == list(np.argmax(logits, axis=1))


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1e-50, top_p=0.9),  # the chat fuzz case: 1e-50 is 0 in float32
        dict(temperature=1e-40, top_p=0.5),  # the completions one: a float32 subnormal
        dict(temperature=1e-30),
        dict(temperature=1e-6, top_k=50, min_p=0.1),
        dict(temperature=float("nan"), top_p=0.9),
    ],
)
def test_temperatures_below_the_floor_are_greedy(params):
    """Below MIN_TEMPERATURE the row is the argmax, and its logprobs are the model's (temperature 1)."""
    logits = make_logits(4)
    reqs = [req(seed=s, want_logprobs=True, num_logprobs=3, **params) for s in range(4)]
    toks, lps = sample_rows(logits, reqs, [0, 1, 2, 3])
    assert toks == list(np.argmax(logits, axis=1))
    for row, tok, lp in zip(logits, toks, lps):
        assert lp.logprob == pytest.approx(log_softmax(row)[tok]) and np.isfinite(lp.logprob)


def test_the_smallest_temperature_above_the_floor_still_draws_from_a_finite_row():
    logits = make_logits(4)
    reqs = [req(seed=s, temperature=MIN_TEMPERATURE, top_p=0.9, want_logprobs=True) for s in range(4)]
    toks, lps = sample_rows(logits, reqs, [0, 1, 2, 3])
    assert toks == list(np.argmax(logits, axis=1)) and all(np.isfinite(lp.logprob) for lp in lps)


def test_input_logits_untouched():
    logits = make_logits(2)
    before = logits.copy()
    sample_rows(logits, [req(temperature=0.5, top_k=3, repetition_penalty=2.0), req()], [0, 0])
    np.testing.assert_array_equal(logits, before)


def test_top_k_mask():
    x = make_logits(1)[0]
    out = process_logits(x.copy(), SamplingParams(top_k=7))
    kept = np.flatnonzero(np.isfinite(out))
    assert set(kept) == set(np.argsort(-x)[:7])
    for s in range(50):
        tok, _ = sample_row(x, req(seed=s, top_k=7), 0)
        assert tok in kept


def test_top_p_mask_keeps_smallest_prefix():
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    x = np.log(probs).astype(np.float32)
    out = process_logits(x.copy(), SamplingParams(top_p=0.7))
    assert list(np.isfinite(out)) == [True, True, False, False]
    out = process_logits(x.copy(), SamplingParams(top_p=0.75))
    assert list(np.isfinite(out)) == [True, True, False, False]
    out = process_logits(x.copy(), SamplingParams(top_p=0.76))
    assert list(np.isfinite(out)) == [True, True, True, False]
    out = process_logits(x.copy(), SamplingParams(top_p=0.01))
    assert list(np.isfinite(out)) == [True, False, False, False]


def _top_p_by_full_sort(x: np.ndarray, top_p: float) -> np.ndarray:
    """The plain definition: sort every survivor, keep the smallest prefix reaching top_p."""
    x = x.copy()
    live = np.flatnonzero(np.isfinite(x))
    order = live[np.argsort(-x[live], kind="stable")]
    e = np.exp(x[order].astype(np.float64) - x[order].max())
    probs = e / e.sum()
    x[order[np.cumsum(probs) - probs >= top_p]] = -np.inf
    return x


@pytest.mark.parametrize("seed", range(6))
def test_top_p_partial_sort_matches_the_full_sort(seed):
    rng = np.random.default_rng(seed)
    vocab = 49152
    for scale in (0.5, 3.0, 12.0):  # flat (widens past the first candidates) to peaked
        x = (rng.standard_normal(vocab) * scale).astype(np.float32)
        x[rng.integers(0, vocab, 300)] = x.max()  # ties at the top
        x[rng.integers(0, vocab, 2000)] = np.round(x[rng.integers(0, vocab, 2000)], 1)  # ties everywhere
        x[rng.integers(0, vocab, 5000)] = -np.inf  # an earlier mask
        for top_p in (0.01, 0.5, 0.9, 0.999):
            got = process_logits(x.copy(), SamplingParams(temperature=1.0, top_p=top_p))
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(_top_p_by_full_sort(x, top_p)))


def test_min_p_mask():
    probs = np.array([0.5, 0.3, 0.12, 0.08])
    x = np.log(probs).astype(np.float32)
    out = process_logits(x.copy(), SamplingParams(min_p=0.2))  # threshold 0.1
    assert list(np.isfinite(out)) == [True, True, True, False]


def test_temperature_scales():
    x = make_logits(1)[0]
    out = process_logits(x.copy(), SamplingParams(temperature=0.5))
    np.testing.assert_allclose(out, x * 2, rtol=1e-6)


def test_repetition_penalty_hf_semantics():
    x = np.array([2.0, -2.0, 2.0, -2.0, 1.0], np.float32)
    apply_penalties(x, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[1, 4, 4])
    np.testing.assert_allclose(x, [1.0, -4.0, 2.0, -2.0, 0.5])


def test_presence_and_frequency_penalties_count_output_only():
    x = np.zeros(5, np.float32)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(x, p, prompt_ids=[0, 2], output_ids=[1, 3, 3, 3])
    np.testing.assert_allclose(x, [0.0, -0.75, 0.0, -1.25, 0.0])


def test_penalty_changes_greedy_choice():
    x = np.array([[5.0, 4.0, 0.0]], np.float32)
    r = SampleRequest(SamplingParams(temperature=0, frequency_penalty=2.0), seed=0, output_token_ids=[0])
    assert sample_rows(x, [r], [0])[0] == [1]


def test_logprobs_normalized_and_consistent():
    logits = make_logits(3)
    reqs = [
        req(seed=1, want_logprobs=True, num_logprobs=5, temperature=0.8),
        req(seed=2, want_logprobs=True, num_logprobs=3, temperature=0.0),
        req(seed=3, want_logprobs=False),
    ]
    toks, lps = sample_rows(logits, reqs, [0, 0, 0])
    assert lps[2] is None
    # Row 1 is greedy: logprobs are of the (penalized) model distribution.
    ref = log_softmax(logits[1])
    assert np.exp(ref).sum() == pytest.approx(1.0)
    assert lps[1].token_id == toks[1]
    assert lps[1].logprob == pytest.approx(ref[toks[1]])
    assert lps[1].top[0] == (toks[1], pytest.approx(ref.max()))
    assert [t for t, _ in lps[1].top] == list(np.argsort(-ref)[:3])
    # Row 0 sampled at temperature 0.8: the logprobs are of logits / 0.8.
    ref0 = log_softmax(logits[0] / np.float32(0.8))
    assert lps[0].logprob == pytest.approx(ref0[toks[0]], abs=1e-6)
    tops = [lp for _, lp in lps[0].top]
    assert len(tops) == 5 and tops == sorted(tops, reverse=True)
    assert all(lp <= 0 for lp in tops)


def test_logprobs_under_truncation_renormalize():
    x = make_logits(1)[0]
    r = req(seed=5, want_logprobs=True, num_logprobs=10, top_k=4)
    tok, lp = sample_row(x, r, 0)
    assert len(lp.top) == 4  # only finite alternatives
    assert sum(np.exp(v) for _, v in lp.top) == pytest.approx(1.0)
    assert tok in [t for t, _ in lp.top]
