"""Rounds planned ahead on the CUDA backend (engine/run_ahead.py, docs/CUDA.md): a row feeding
PENDING embeds the token the round before drew, read on the device from that round's ``out``,
and ``step(defer=True)`` hands a plain round back queued, so the next one is on the stream
before the host reads its tokens. Tokens and KV books must be the synchronous loop's, greedy and
seeded, lanes stopping mid-run included. Skipped without a device."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.backend import PENDING, DecodeLane, PrefillSpan, SampleRequest, StepPlan
from engine.sampling import SamplingParams
from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]

TOKENS = 24


@pytest.fixture(scope="module")
def llama():
    from engine.backends import create_backend
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.test_cuda_archs import random_weights

    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position=2048, tie_word_embeddings=True)  # fmt: skip
    be = create_backend("cuda", EngineConfig(backend="cuda"))
    plan = be.load(cfg, random_weights(definition("llama"), cfg, seed=5), block_size=16, kv_budget_bytes=64 << 20,
                   host_kv_budget_bytes=0, max_context=512)  # fmt: skip
    yield be, plan
    be.unload()


def generate(llama, width: int, sampling: dict, *, ahead: bool, defer: bool, stop_at=None):
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest
    from engine.scheduler import Scheduler
    from tests.engine.fake_backend import FakeClock, tokens_of
    from tests.engine.test_run_ahead import drive
    from tests.engine.test_scheduler import assert_pool_drained

    be, plan = llama
    cfg = EngineConfig(decode_lanes=8, prefill_chunk=256, max_context=512, block_size=16, spec_enabled=False)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), clock=FakeClock(), seed_rng=random.Random(0),
                      max_round_rows=be.max_round_rows)  # fmt: skip
    rng = np.random.default_rng(width)
    for i in range(width):
        prompt = rng.integers(0, 512, 5 + 7 * i).tolist()
        add = AddRequest(f"p{i}", "c", prompt, TOKENS - i, sampling={**sampling, "ignore_eos": True})
        add.stop_token_ids = [stop_at[add.request_id]] if stop_at and add.request_id in stop_at else []
        assert sched.add_request(add) is None
    deferred = []
    finish = be.finish

    def counting(out):
        deferred.append(out.unfinished is not None)
        return finish(out)

    be.finish = counting
    try:
        outputs, num_ahead, books = drive(sched, be, ahead=ahead, clock=sched.clock, defer=defer)
    finally:
        del be.finish
    assert_pool_drained(sched)
    return {rid: tokens_of(o) for rid, o in outputs.items()}, num_ahead, books, sum(deferred)


@pytest.mark.parametrize("width", [1, 3, 8])
def test_greedy_tokens_and_books_are_the_same_ahead_or_not(llama, width):
    greedy = {"temperature": 0}
    sync, _, _, _ = generate(llama, width, greedy, ahead=False, defer=False)
    stop_at = {"p0": sync["p0"][TOKENS // 2]}  # p0 ends on a stop token halfway
    sync, _, books_sync, _ = generate(llama, width, greedy, ahead=False, defer=False, stop_at=stop_at)
    ahead, num_ahead, books_ahead, deferred = generate(llama, width, greedy, ahead=True, defer=True, stop_at=stop_at)
    assert num_ahead >= TOKENS // 4 and deferred >= num_ahead  # most rounds ran ahead, queued on the card
    assert ahead == sync and books_ahead == books_sync
    host, _, _, none = generate(llama, width, greedy, ahead=True, defer=False, stop_at=stop_at)
    assert host == sync and none == 0  # ahead, each round read back in its step: PENDING fed from the host


def test_seeded_sampling_is_the_same_ahead_or_not(llama):
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 3, "min_tokens": 4}
    sync, _, _, _ = generate(llama, 4, sampled, ahead=False, defer=False)
    ahead, num_ahead, _, deferred = generate(llama, 4, sampled, ahead=True, defer=True)
    assert num_ahead > 0 and deferred > 0 and ahead == sync


def _lane(seq_id, token, pos, table, want_logprobs=False):
    req = SampleRequest(SamplingParams(temperature=0.0), seed=1, want_logprobs=want_logprobs)
    return DecodeLane(seq_id=seq_id, token_id=token, position=pos, block_table=table, sample=req)


def _prefilled(be, seq_id, n, table):
    req = SampleRequest(SamplingParams(temperature=0.0), seed=1)
    be.step(StepPlan(prefill=PrefillSpan(seq_id=seq_id, token_ids=list(range(1, n + 1)), start_pos=0,
                                         block_table=table, sample=req)))  # fmt: skip


def test_a_round_queued_behind_one_that_raised_raises_before_it_replays(llama):
    be, _ = llama
    _prefilled(be, 1, 5, [0])
    be.step(StepPlan(decode=[_lane(1, 7, 5, [0])]), defer=True)
    with pytest.raises(ValueError):  # position 40 is past its one-block table: raises before its replay
        be.step(StepPlan(decode=[_lane(1, PENDING, 40, [0])]), defer=True)
    with pytest.raises(KeyError):  # fed what the failed round would have drawn: refused, never stale
        be.step(StepPlan(decode=[_lane(1, PENDING, 41, [0, 1, 2])]), defer=True)


def test_a_round_reading_logits_back_completes_in_its_step_and_feeds_the_next(llama):
    """A row asking for logprobs keeps its round on the host (not deferred), and a PENDING row behind
    a deferred round reads the right token: the same as feeding it from the host."""
    be, _ = llama
    _prefilled(be, 1, 9, [0])
    first = be.finish(be.step(StepPlan(decode=[_lane(1, 3, 9, [0])]), defer=True))
    second = be.step(StepPlan(decode=[_lane(1, PENDING, 10, [0], want_logprobs=True)]), defer=True)
    assert second.unfinished is None and second.decode_logprobs[0] is not None
    # The same two rounds fed from the host.
    _prefilled(be, 2, 9, [1])
    be.step(StepPlan(decode=[_lane(2, 3, 9, [1])]))
    again = be.step(StepPlan(decode=[_lane(2, first.decode_tokens[0], 10, [1], want_logprobs=True)]))
    assert second.decode_tokens == again.decode_tokens
