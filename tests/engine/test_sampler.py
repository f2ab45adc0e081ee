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


# --- the sampler's partial passes against the dense implementation and plain references ---------

from engine import sampler, truncation  # noqa: E402

from . import sampler_before  # noqa: E402  (the dense implementation, as it was)


def _row(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Logits as a model's, flat to peaked, with the rows' usual trouble: ties, rounded values, masks."""
    x = (rng.standard_normal(vocab) * rng.choice([0.5, 1.5, 2.5, 4.0, 10.0])).astype(np.float32)
    if rng.random() < 0.3:
        x = np.round(x, 1)  # ties everywhere
    if rng.random() < 0.3:
        x[rng.integers(0, vocab, int(rng.integers(2, 60)))] = x.max()  # ties at the top
    if rng.random() < 0.3:
        x[rng.integers(0, vocab, vocab // 5)] = -np.inf  # a grammar's mask
    if rng.random() < 0.1:
        x[rng.integers(0, vocab, 3)] = 0.0
        x[rng.integers(0, vocab, 3)] = -0.0
    return x


def _params(rng: np.random.Generator) -> dict:
    p: dict = dict(temperature=float(rng.choice([0.0, MIN_TEMPERATURE, 0.3, 0.7, 1.0, 1.6])))
    if rng.random() < 0.6:
        p["top_p"] = float(rng.choice([1e-9, 0.01, 0.5, 0.8, 0.9, 0.95, 0.999, 1 - 1e-12]))
    if rng.random() < 0.4:
        p["top_k"] = int(rng.choice([1, 2, 5, 40, 50, 300]))
    if rng.random() < 0.3:
        p["min_p"] = float(rng.choice([1e-4, 0.05, 0.2, 0.9]))
    if rng.random() < 0.3:
        p["repetition_penalty"] = float(rng.choice([0.9, 1.1, 1.5]))
    if rng.random() < 0.3:
        p["presence_penalty"], p["frequency_penalty"] = float(rng.uniform(-1, 1)), float(rng.uniform(-1, 1))
    if rng.random() < 0.2:
        p["logit_bias"] = tuple((int(t), float(rng.uniform(-100, 100))) for t in rng.integers(0, 1000, 5))
    return p


def _request(rng: np.random.Generator, vocab: int, seed: int) -> SampleRequest:
    history = [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 400)))]
    cut = int(rng.integers(0, len(history) + 1))
    want = bool(rng.random() < 0.4)
    return SampleRequest(
        SamplingParams(**_params(rng)), seed=seed, prompt_token_ids=history[:cut], output_token_ids=history[cut:],
        want_logprobs=want, num_logprobs=int(rng.choice([0, 1, 5])) if want else 0,
        suppress_token_ids=[int(t) for t in rng.integers(0, vocab, 2)] if rng.random() < 0.2 else (),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_rows_are_the_dense_implementations_bit_for_bit(seed):
    """Tokens, logprobs and masked rows equal to the dense passes' on many rows and parameter sets."""
    rng = np.random.default_rng(100 + seed)
    for trial in range(60):
        vocab = int(rng.choice([50, 3000, 49152]))
        x = _row(rng, vocab)
        for draw_seed in range(2):
            r = _request(rng, vocab, draw_seed)
            pos = int(rng.integers(0, 10_000))
            assert sampler.sample_row(x, r, pos) == sampler_before.sample_row(x, r, pos), (trial, r.params)
        p = SamplingParams(**{**_params(rng), "temperature": 0.8})
        np.testing.assert_array_equal(sampler.process_logits(x, p), sampler_before.process_logits(x, p))


def _reference_token(x: np.ndarray, p: SamplingParams, seed: int, position: int) -> int:
    """The plain definition, float64 and full sorts: temperature, top-k (no tie at its boundary in the
    rows given), min-p, top-p over the stable descending order, an inverse-CDF draw in index order."""
    y = (x / np.float32(p.temperature)).astype(np.float64)
    alive = np.isfinite(y)
    if p.top_k:
        alive &= y >= np.sort(y[alive])[::-1][p.top_k - 1]
    if p.min_p:
        alive &= y >= np.float32(y[alive].max()) + np.float32(np.log(p.min_p))
    if p.top_p < 1.0:
        live = np.flatnonzero(alive)
        order = live[np.argsort(-y[live], kind="stable")]
        probs = np.exp(y[order] - y[order].max())
        probs /= probs.sum()
        alive[order[np.cumsum(probs) - probs >= p.top_p]] = False
    live = np.flatnonzero(alive)
    probs = np.exp(y[live] - y[live].max())
    cdf = np.cumsum(probs / probs.sum())
    return int(live[min(int(np.searchsorted(cdf, sampler.uniform(seed, position) * cdf[-1], side="right")),
                        len(live) - 1)])  # fmt: skip


def test_tokens_follow_the_plain_definition():
    """On rows without ties at a top-k boundary: the token of the plain full-sort float64 definition."""
    rng = np.random.default_rng(7)
    agree = total = 0
    for trial in range(150):
        x = (rng.standard_normal(49152) * rng.choice([1.0, 2.5, 5.0])).astype(np.float32)
        x[rng.integers(0, 49152, 3000)] = -np.inf
        p = SamplingParams(temperature=float(rng.choice([0.5, 0.8, 1.0])), top_k=int(rng.choice([0, 0, 40])),
                           top_p=float(rng.choice([0.5, 0.9, 1.0])), min_p=float(rng.choice([0.0, 0.0, 0.02])))  # fmt: skip
        tok, _ = sampler.sample_row(x, SampleRequest(p, seed=trial), trial)
        total += 1
        agree += tok == _reference_token(x, p, trial, trial)
    # float64 rounding of the reference's own sums may move a draw at a CDF boundary: (almost) never
    assert agree >= total - 1


def test_descending_is_the_stable_argsort():
    rng = np.random.default_rng(3)
    for n in (1, 2, 17, 1000, 40000):
        x = np.round(rng.standard_normal(n) * 3, int(rng.integers(0, 3))).astype(np.float32)
        x[rng.integers(0, n, max(1, n // 10))] = 0.0
        x[rng.integers(0, n, max(1, n // 10))] = -0.0
        x[rng.integers(0, n, max(1, n // 50))] = np.float32(3e38)
        x[rng.integers(0, n, max(1, n // 50))] = np.float32(-3e38)
        idx = np.sort(rng.choice(n, size=max(1, n // 2), replace=False))
        np.testing.assert_array_equal(truncation.descending(x, idx), idx[np.argsort(-x[idx], kind="stable")])


def test_nucleus_at_its_boundaries_is_the_histogram_cut():
    """top_p exactly at, and one ulp either side of, the cumulative masses of the full sort: the same
    kept set as the histogram cut the sampler used before (ties of mass included)."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        x = _row(rng, int(rng.choice([100, 6000, 49152])))
        xl = x[np.isfinite(x)]
        order = np.argsort(-xl, kind="stable")
        probs = np.exp(xl[order].astype(np.float64) - float(xl.max()))
        cum = np.cumsum(probs / probs.sum())
        for k in rng.integers(0, min(len(cum), 3000), 4):
            for top_p in (cum[k], np.nextafter(cum[k], 0), np.nextafter(cum[k], 2)):
                if 0 < top_p < 1:
                    got = truncation.nucleus(xl, float(top_p))
                    np.testing.assert_array_equal(got, np.sort(truncation.nucleus_by_bins(xl, float(top_p))))


def test_block_search_is_the_cumulative_sums_answer_or_declines():
    rng = np.random.default_rng(5)
    declined = 0  # of the random uniforms (those at a CDF step, or at the total, may be declined)
    for _ in range(300):
        n = int(rng.choice([1025, 5000, 49152]))
        x = rng.standard_normal(n) * rng.choice([1.0, 4.0, 30.0])
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        cdf = np.cumsum(probs)
        # uniforms at random, and at the CDF's own steps (where the two sums could disagree)
        j0 = int(rng.integers(0, n))
        us = (rng.random(), cdf[j0] / cdf[-1], np.nextafter(cdf[j0] / cdf[-1], 0), 0.0, 1 - 2**-53)
        for u in us:
            got = sampler._search_blocks(probs, float(u))
            if got is None:
                declined += u == us[0]
                continue
            want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
            assert got == want and probs[got] > 0
    assert declined < 15  # it answers (almost) every one


def test_top_k_with_a_tie_at_its_boundary_keeps_argpartitions_choice():
    x = np.array([5, 4, 3, 3, 3, 1, 0] * 2000, np.float32)
    for k in (2, 3, 4, 5, 100):
        p = SamplingParams(temperature=1.0, top_k=k)
        np.testing.assert_array_equal(sampler.process_logits(x, p), sampler_before.process_logits(x, p))
        for s in range(5):
            r = SampleRequest(p, seed=s, want_logprobs=True, num_logprobs=3)
            assert sampler.sample_row(x, r, s) == sampler_before.sample_row(x, r, s)


def _outcome(f, *args):
    try:
        return f(*args)
    except ValueError as e:  # a row that leaves nothing to reduce over raises in both
        return type(e)


def test_rows_with_nan_or_inf_keep_the_dense_behaviour():
    rng = np.random.default_rng(2)
    for bad in (np.nan, np.inf):
        x = (rng.standard_normal(6000) * 2).astype(np.float32)
        x[[5, 77]] = bad
        for p in (SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(min_p=0.1, top_p=0.5)):
            with np.errstate(invalid="ignore"):
                got, want = _outcome(sampler.process_logits, x, p), _outcome(sampler_before.process_logits, x, p)
            if isinstance(want, type):
                assert got is want
            else:
                np.testing.assert_array_equal(got, want)


def test_uniform_is_numpys_philox():
    """The draw's uniform: numpy's Philox generator's first double for key (seed, position), counter stream."""
    m = (1 << 64) - 1
    rng = np.random.default_rng(9)
    keys = [(0, 0, 0), (1, 5, 0), (m, m, 7), (2**63, 3, m), (-1, -5, 3), (12345, 2**40, 2**64 + 5)]
    keys += [tuple(int(v) for v in k) for k in zip(rng.integers(0, 2**63, 500), rng.integers(0, 2**40, 500),
                                                   rng.integers(0, 20, 500))]  # fmt: skip
    for seed, pos, stream in keys:
        key = np.array([seed & m, pos & m], dtype=np.uint64)
        want = float(np.random.Generator(np.random.Philox(key=key, counter=stream)).random())
        assert sampler.uniform(seed, pos, stream) == want, (seed, pos, stream)
