"""logit_bias, min_tokens and ignore_eos (issue 11 point 9): honoured by the sampler and admission."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import SampleRequest
from engine.sampler import sample_row
from engine.sampling import SamplingParams
from tests.engine.fake_backend import create_requests, create_scheduler, finished_of, run_until_done, tokens_of
from tests.engine.test_scheduler import expected_tokens

VOCAB = 64


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=VOCAB).astype(np.float32)


def test_params_cross_the_layer_as_lists_and_stay_hashable():
    p = SamplingParams.from_dict({"logit_bias": [[5, 100], [7, -100.0]], "min_tokens": 3, "ignore_eos": True})
    assert p.logit_bias == ((5, 100.0), (7, -100.0)) and p.min_tokens == 3 and p.ignore_eos
    hash(p)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_logit_bias_forces_and_bans_tokens():
    x = logits()
    best = int(np.argmax(x))
    forced = SampleRequest(SamplingParams(temperature=0.0, logit_bias=((3, 100.0),)), seed=1)
    assert sample_row(x, forced, 0)[0] == 3
    banned = SampleRequest(SamplingParams(temperature=0.0, logit_bias=((best, -100.0),)), seed=1)
    assert sample_row(x, banned, 0)[0] != best
    # Sampled rows too: a +100 bias takes all the mass.
    hot = SampleRequest(SamplingParams(temperature=1.0, logit_bias=((9, 100.0),)), seed=5)
    assert {sample_row(x, hot, pos)[0] for pos in range(20)} == {9}
    # Ids outside the vocabulary never fail the row (the API refuses them before).
    outside = SampleRequest(SamplingParams(temperature=0.0, logit_bias=((VOCAB + 10, 5.0),)), seed=1)
    assert sample_row(x, outside, 0)[0] == best


def test_suppressed_tokens_are_never_drawn_and_never_leave_nothing():
    x = logits(1)
    best = int(np.argmax(x))
    req = SampleRequest(SamplingParams(temperature=0.0), seed=1, suppress_token_ids=(best,))
    token, lp = sample_row(x, SampleRequest(req.params, 1, suppress_token_ids=(best,), want_logprobs=True), 0)
    assert token != best and np.isfinite(lp.logprob)
    everything = SampleRequest(SamplingParams(temperature=0.0), seed=1, suppress_token_ids=tuple(range(VOCAB)))
    assert sample_row(x, everything, 0)[0] == best  # a mask that would leave nothing is not applied


def test_min_tokens_suppresses_the_stop_ids_until_enough_are_out():
    sched, backend, clock = create_scheduler()
    (r,) = create_requests(1, max_tokens=10, sampling={"min_tokens": 2})
    r.stop_token_ids = [7, 3]
    sched.add_request(r)
    seq = sched.seqs[r.request_id]
    assert list(seq.sample_request().suppress_token_ids) == [3, 7]
    seq.output_token_ids.extend([1, 2])
    assert list(seq.sample_request().suppress_token_ids) == []


def test_ignore_eos_runs_past_the_stop_token_to_max_tokens():
    (r,) = create_requests(1, max_tokens=6, sampling={"ignore_eos": True})
    r.stop_token_ids = [expected_tokens(r, 3)[2]]
    sched, backend, clock = create_scheduler()
    sched.add_request(r)
    assert sched.seqs[r.request_id].stop_token_ids == frozenset()
    msgs = run_until_done(sched, backend, clock)[r.request_id]
    assert tokens_of(msgs) == expected_tokens(r, 6)
    assert finished_of(msgs).finish_reason == "length"


class OnlyEos:
    """A grammar at its end: it admits the stop token alone."""

    def __init__(self, eos: int):
        self.eos = eos

    def mask_logits(self, x: np.ndarray) -> None:
        keep = x[self.eos]
        x[:] = -np.inf
        x[self.eos] = keep


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_that_admits_only_the_stop_token_still_ends_under_min_tokens(temperature):
    req = SampleRequest(SamplingParams(temperature=temperature), seed=3, constraint=OnlyEos(5), suppress_token_ids=(5,))
    assert sample_row(logits(2), req, 0)[0] == 5


def test_cuda_rows_with_a_bias_or_suppression_are_drawn_on_the_host():
    """The CUDA backend's device draw knows no bias: such a row reads its logits back and is drawn by
    the host sampler (engine/backends/cuda/sampling.py; no GPU needed for this part)."""
    from engine.backends.cuda import sampling as cuda_sampling

    x = logits(4)
    plain = SampleRequest(SamplingParams(temperature=0.0), seed=1)
    biased = SampleRequest(SamplingParams(temperature=0.0, logit_bias=((11, 100.0),)), seed=1)
    held = SampleRequest(SamplingParams(temperature=0.0), seed=1, suppress_token_ids=(int(np.argmax(x)),))
    assert not cuda_sampling.needs_logits(plain) and cuda_sampling.finish_row(x, plain, 42, 0) == (42, None)
    assert cuda_sampling.needs_logits(biased) and cuda_sampling.finish_row(x, biased, 42, 0)[0] == 11
    assert cuda_sampling.needs_logits(held) and cuda_sampling.finish_row(x, held, int(np.argmax(x)), 0)[0] != np.argmax(
        x
    )
