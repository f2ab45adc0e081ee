"""Speculative rounds through the scheduler: the same tokens as without, fewer rounds, exact books."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import AddRequest, RequestFinished, TokenEvent
from engine.scheduler import Scheduler
from tests.engine.fake_backend import FakeBackend, FakeClock

LOOP_VOCAB = 11


class LoopyBackend(FakeBackend):
    """The fake's KV books, with a model whose output falls into cycles (prompt lookup can guess it)."""

    @staticmethod
    def next_token(context: Sequence[int]) -> int:
        a, b = context[-2] if len(context) > 1 else 0, context[-1]
        return (a * 7 + b * 3 + 1) % LOOP_VOCAB


def run(reqs: list[AddRequest], *, rows: int, num_blocks: int = 64, block_size: int = 4, host: int = 64,
        lanes: int = 4, spec_enabled: bool = True, check=None):  # fmt: skip
    cfg = EngineConfig(decode_lanes=lanes, prefill_chunk=16, max_context=512, block_size=block_size,
                       default_max_tokens=16, spec_enabled=spec_enabled)  # fmt: skip
    kv = KVManager(num_blocks, block_size, host)
    sched = Scheduler(cfg, kv, clock=FakeClock(), seed_rng=random.Random(0), max_round_rows=rows)
    backend = LoopyBackend(num_blocks, block_size, host)
    backend.load(None, {}, block_size=block_size, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=512)
    for r in reqs:
        assert sched.add_request(r) is None
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done: dict[str, RequestFinished] = {}
    rounds = 0
    while sched.has_work:
        plan = sched.schedule()
        assert len(plan.decode) <= max(rows, len(sched.running))
        rounds += bool(plan.decode)
        for out in sched.update_from_output(plan, backend.step(plan)):
            if isinstance(out, TokenEvent):
                tokens[out.request_id] += out.token_ids
            else:
                done[out.request_id] = out
        for seq in sched.running:  # rejected drafts leave no page behind
            assert kv.blocks_for(seq.num_tokens - 1) <= len(seq.block_table) <= kv.blocks_for(seq.num_tokens)
        if check:
            check(sched, plan)
    assert kv.usage()["used"] == 0 and kv.num_available_blocks == num_blocks
    return tokens, done, rounds, sched


def requests(n: int, *, max_tokens: int = 60, **kw) -> list[AddRequest]:
    rng = random.Random(1)
    return [
        AddRequest(
            f"r{i}", "c", [rng.randrange(LOOP_VOCAB) for _ in range(9)], max_tokens, sampling={"temperature": 0}, **kw
        )  # fmt: skip
        for i in range(n)
    ]


def test_speculation_commits_the_same_tokens_in_fewer_rounds():
    off, done_off, rounds_off, _ = run(requests(3), rows=0)
    on, done_on, rounds_on, sched = run(requests(3), rows=16)
    assert on == off
    assert {k: (d.finish_reason, d.completion_tokens) for k, d in done_on.items()} == {
        k: (d.finish_reason, d.completion_tokens) for k, d in done_off.items()
    }
    assert rounds_on < rounds_off / 2  # the loopy model's cycles are guessed
    stats = sched.make_stats()
    assert stats.spec_drafted["prompt_lookup"] >= stats.spec_accepted["prompt_lookup"] > 0


def test_no_round_carries_more_rows_than_the_backend_takes():
    seen = []
    run(requests(4), rows=6, check=lambda s, plan: seen.append(len(plan.decode)))
    assert max(seen) <= 6 and max(seen) > 4  # drafts used the two spare rows


def test_a_stop_inside_the_kept_run_ends_the_request_there():
    off, done_off, _, _ = run(requests(3, stop_token_ids=[5]), rows=0)
    on, done_on, _, _ = run(requests(3, stop_token_ids=[5]), rows=16)
    assert on == off
    assert [d.finish_reason for d in done_on.values()] == [d.finish_reason for d in done_off.values()]
    assert any(d.finish_reason == "stop" for d in done_on.values())


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 33])
def test_max_tokens_is_exact(max_tokens):
    on, done, _, _ = run(requests(2, max_tokens=max_tokens), rows=16)
    assert all(len(t) == max_tokens for t in on.values())
    assert all(d.finish_reason == "length" and d.completion_tokens == max_tokens for d in done.values())


def test_turned_off_nothing_is_drafted():
    _, _, _, sched = run(requests(2), rows=16, spec_enabled=False)
    assert sched.make_stats().spec_drafted == {}


def test_predicted_outputs_are_proposed_and_counted():
    (ref,) = run(requests(1), rows=0)[0].values()
    good = requests(1, prediction_token_ids=ref[:40] + [3, 3, 3])
    on, done, rounds, sched = run(good, rows=16)
    assert list(on.values()) == [ref]
    d = done["r0"]
    assert d.accepted_prediction_tokens >= 35 and d.rejected_prediction_tokens >= 1
    assert sched.make_stats().spec_accepted["prediction"] == d.accepted_prediction_tokens


def test_preempted_and_swapped_lanes_with_drafts_reproduce_the_plain_run():
    kw = dict(num_blocks=24, block_size=4, host=64, lanes=4)
    off, _, _, _ = run(requests(4, max_tokens=40), rows=0, **kw)
    on, _, _, sched = run(requests(4, max_tokens=40), rows=16, **kw)
    assert on == off
    assert sched.counters["preempted"] > 0  # the small pool forced it
