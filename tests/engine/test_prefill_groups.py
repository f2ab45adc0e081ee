"""Prompts that arrive together prefill in one step (issue 15 point 4): the scheduler's groups on the
fake backend. The fake's tokens hash the context each row reads back from its slots, so a span
written into the wrong pages, or reading another's, changes the output."""

from __future__ import annotations

import random

import pytest

from engine.sequence import SequenceStatus
from tests.engine.fake_backend import create_requests, create_scheduler, run_until_done, step, tokens_of
from tests.engine.test_scheduler import assert_pool_drained, expected_tokens

ABORTED = SequenceStatus.FINISHED_ABORTED


def spans_of(plan) -> list[tuple[int, int, int]]:
    """(seq_id, start_pos, tokens) of each prefill span of ``plan``."""
    return [(s.seq_id, s.start_pos, len(s.token_ids)) for s in plan.prefills]


def test_a_burst_prefills_in_one_step_as_far_as_the_chunk_goes():
    sched, backend, clock = create_scheduler(prefill_chunk=64, num_blocks=128, decode_lanes=8)
    reqs = create_requests(8, prompt_len=10, max_tokens=4)
    for r in reqs:
        sched.add_request(r)
    first = sched.schedule()
    assert spans_of(first) == [(i, 0, 10) for i in range(6)]  # 6 x 10 fit 64; the 7th would not
    assert all(s.sample is not None for s in first.prefills)
    outs = sched.update_from_output(first, backend.step(first))
    assert [o.request_id for o in outs] == [r.request_id for r in reqs[:6]]  # every first token in one step
    assert spans_of(sched.schedule()) == [(6, 0, 10), (7, 0, 10)]  # the rest: the next group


def test_a_backend_that_prefills_span_by_span_gets_no_groups():
    """A backend whose prefill_group is the default loop (Backend.prefills_together False, the
    default) gains nothing from a group: its first prompts would only wait for the last."""
    sched, backend, clock = create_scheduler(prefill_chunk=64, num_blocks=128, decode_lanes=8)
    sched.groups_prefill = False  # as engine.loading sets it from such a backend
    for r in create_requests(3, prompt_len=10, max_tokens=4):
        sched.add_request(r)
    first = sched.schedule()
    assert spans_of(first) == [(0, 0, 10)]
    sched.update_from_output(first, backend.step(first))
    assert spans_of(sched.schedule()) == [(1, 0, 10)]


@pytest.mark.parametrize("group", [True, False])
def test_random_bursts_keep_the_chunk_budget_and_the_tokens(group):
    rng = random.Random()
    sched, backend, clock = create_scheduler(prefill_chunk=32, num_blocks=256, decode_lanes=24, max_context=512)
    sched.cfg.prefill_group = group
    reqs = create_requests(2, prompt_len=5)  # a group at least, whatever the draw
    for i in range(2, 24):
        reqs += create_requests(1, prompt_len=rng.randint(2, 45), max_tokens=rng.randint(1, 8), start=i)
    for r in reqs:
        assert sched.add_request(r) is None
    msgs = run_until_done(sched, backend, clock)
    for r in reqs:
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, r.max_tokens)
    plans = [p for p in backend.plans if p.prefill is not None]
    assert all(sum(len(s.token_ids) for s in p.prefills) <= 32 for p in plans)
    # a group's members prefill whole: each of their spans is its prompt's last
    assert all(s.sample is not None for p in plans for s in p.prefill_more)
    assert any(p.prefill_more for p in plans) == group
    assert sum(len(p.prefills) for p in plans) == sum(-(-len(r.prompt_token_ids) // 32) for r in reqs)
    assert_pool_drained(sched)


def test_a_prompt_that_does_not_fit_whole_ends_the_group():
    sched, backend, clock = create_scheduler(prefill_chunk=32, num_blocks=128)
    reqs = create_requests(1, prompt_len=10) + create_requests(1, prompt_len=30, start=1)
    reqs += create_requests(1, prompt_len=10, start=2)
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()
    assert spans_of(plan) == [(0, 0, 10)]  # 30 does not fit in 22, and 10 does not jump it
    sched.update_from_output(plan, backend.step(plan))
    plan = sched.schedule()
    assert spans_of(plan) == [(1, 0, 30)]  # it leads the next step; the 10 behind it no longer fits
    sched.update_from_output(plan, backend.step(plan))
    assert spans_of(sched.schedule()) == [(2, 0, 10)]


def test_the_gate_counts_the_whole_group():
    sched, backend, clock = create_scheduler(
        prefill_chunk=64, decode_share=0.25, num_blocks=128, prefill_seconds=0.01, decode_lanes=16
    )
    (lane,) = create_requests(1, prompt_len=4, max_tokens=100)
    sched.add_request(lane)
    step(sched, backend, clock)  # 4 tokens in 0.04 s with no lane decoding: no debt; now a lane decodes
    burst = create_requests(8, prompt_len=10, start=1)
    for r in burst:
        sched.add_request(r)
    # Six prompts take the lane. Whole in their chunk, they do not wait for their own estimated
    # time, and the lane's own prompt ran while nothing decoded: they run at once, beside its round.
    plan = sched.schedule()
    assert [s[0] for s in spans_of(plan)] == [1, 2, 3, 4, 5, 6] and len(plan.decode) == 1
    out = backend.step(plan)
    assert out.prefill_seconds == pytest.approx(0.6)
    sched.update_from_output(plan, out)
    assert [s.status for s in sched.seqs.values()].count(SequenceStatus.DECODING) == 7
    plan = sched.schedule()  # the last two take the lane; after the group's 0.6 s the lanes run 0.2 s alone
    assert plan.prefill is None and [sched.prefilling.seq_id] + [s.seq_id for s in sched.joined] == [7, 8]
    assert sched.prefill_wait() == pytest.approx(0.2)
    sched.update_from_output(plan, backend.step(plan))
    clock.advance(0.2)
    assert [s[0] for s in spans_of(sched.schedule())] == [7, 8]


def test_a_chunk_with_no_lane_decoding_leaves_no_debt():
    """The first of a burst prefills alone (nothing decodes yet); the rest, arrived meanwhile, run in
    the next step beside its first round, not a round later: that chunk stalled no lane. A chunk that
    ran beside a lane still holds the next one for the lanes' share."""
    sched, backend, clock = create_scheduler(
        prefill_chunk=64, decode_share=0.25, num_blocks=128, prefill_seconds=0.01, decode_lanes=16
    )
    first, *rest = create_requests(4, prompt_len=10, max_tokens=50)
    sched.add_request(first)
    plan = sched.schedule()
    assert spans_of(plan) == [(0, 0, 10)] and not plan.decode
    for r in rest:
        sched.add_request(r)  # arrive while its prefill runs
    out = backend.step(plan)
    clock.advance(out.prefill_seconds)
    sched.update_from_output(plan, out)
    assert sched.prefill_wait() is None  # nothing held
    plan = sched.schedule()
    assert [s[0] for s in spans_of(plan)] == [1, 2, 3] and [ln.seq_id for ln in plan.decode] == [0]
    out = backend.step(plan)
    clock.advance(out.prefill_seconds + out.decode_seconds)
    sched.update_from_output(plan, out)
    (late,) = create_requests(1, prompt_len=10, max_tokens=5, start=4)
    sched.add_request(late)
    plan = sched.schedule()
    assert plan.prefill is None and len(plan.decode) == 4  # the group's 0.3 s stalled a lane: 0.1 s alone
    assert sched.prefill_wait() == pytest.approx(0.1, abs=0.01)


def test_without_groups_the_gate_counts_one_prompt():
    sched, backend, clock = create_scheduler(
        prefill_chunk=64, decode_share=0.25, num_blocks=128, prefill_seconds=0.01, decode_lanes=16
    )
    sched.cfg.prefill_group = False
    (lane,) = create_requests(1, prompt_len=4, max_tokens=100)
    sched.add_request(lane)
    step(sched, backend, clock)
    for r in create_requests(8, prompt_len=10, start=1):
        sched.add_request(r)
    plan = sched.schedule()  # the lane's prompt ran while nothing decoded: nothing is owed
    assert spans_of(plan) == [(1, 0, 10)]
    sched.update_from_output(plan, backend.step(plan))
    assert sched.schedule().prefill is None
    assert sched.prefill_wait() == pytest.approx(10 * 0.01 / 3)  # one prompt's 0.1 s, not eight


def gated_group(n: int = 4):
    """A lane decodes, a one-token answer prefilled beside it leaves a debt, and a group of ``n``
    prompts of 10 (seq ids 2..) waits on the gate (its spans not yet run)."""
    sched, backend, clock = create_scheduler(prefill_chunk=64, num_blocks=128, decode_lanes=8, prefill_seconds=0.01)
    lane, answer = create_requests(1, prompt_len=4, max_tokens=30) + create_requests(
        1, prompt_len=6, max_tokens=1, start=9
    )
    sched.add_request(lane)
    step(sched, backend, clock)
    sched.add_request(answer)
    step(sched, backend, clock)  # beside the lane's round: 0.06 s owed back before the next chunk
    burst = create_requests(n, prompt_len=10, max_tokens=6, start=1)
    for r in burst:
        sched.add_request(r)
    plan = sched.schedule()
    assert plan.prefill is None and sched.prefilling.seq_id == 2 and [s.seq_id for s in sched.joined] == [3, 4, 5]
    sched.update_from_output(plan, backend.step(plan))
    return sched, backend, clock, lane, burst


@pytest.mark.parametrize("who", [0, 1, 3])  # the lead, a member, the last member
def test_a_group_member_aborted_before_its_span_runs(who):
    sched, backend, clock, lane, burst = gated_group()
    used = sched.kv.usage()["used"]
    gone = burst[who]
    sched.finish_requests(gone.request_id, ABORTED)
    assert sched.kv.usage()["used"] == used - 3  # its 3 pages back at once
    clock.advance(1.0)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.prefills] == [i + 2 for i in range(4) if i != who]
    sched.update_from_output(plan, backend.step(plan))
    msgs = run_until_done(sched, backend, clock)
    assert gone.request_id not in msgs
    for r in [lane] + burst:
        if r is not gone:
            assert (
                tokens_of(msgs[r.request_id]) == expected_tokens(r, r.max_tokens)[-len(tokens_of(msgs[r.request_id])) :]
            )
    assert_pool_drained(sched)


@pytest.mark.parametrize("who", [0, 2])
def test_a_group_member_aborted_while_its_span_runs(who):
    sched, backend, clock, lane, burst = gated_group()
    clock.advance(1.0)
    plan = sched.schedule()
    assert len(plan.prefills) == 4
    out = backend.step(plan)
    sched.finish_requests(burst[who].request_id, ABORTED)  # the plan was handed out: its result is ignored
    outs = sched.update_from_output(plan, out)
    assert burst[who].request_id not in {o.request_id for o in outs}
    assert sched.prefilling is None and not sched.joined
    msgs = run_until_done(sched, backend, clock)
    for r in burst:
        if r is not burst[who]:
            assert tokens_of(msgs[r.request_id]) == expected_tokens(r, 6)[1:]
    assert_pool_drained(sched)


def test_grouped_prompts_free_their_pages_when_they_finish_or_abort():
    sched, backend, clock = create_scheduler(prefill_chunk=64, num_blocks=64, decode_lanes=8)
    reqs = create_requests(5, prompt_len=10, max_tokens=8)
    for r in reqs:
        sched.add_request(r)
    step(sched, backend, clock)  # one group: every first token
    assert sched.counters["prefill_chunks"] == 5 and len(sched.running) == 5
    sched.finish_requests([reqs[1].request_id, reqs[3].request_id], ABORTED)
    msgs = run_until_done(sched, backend, clock)
    for r in (reqs[0], reqs[2], reqs[4]):
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, 8)[1:]
    assert_pool_drained(sched)


def test_a_preemption_while_a_group_waits_on_the_gate():
    """Two agent lanes grow while an interactive group waits on the gate: the pool runs dry, the
    lowest-ranked lane moves to host (the group's pages stay), comes back, and every request ends
    with the undisturbed tokens."""
    sched, backend, clock = create_scheduler(
        prefill_chunk=32, num_blocks=14, block_size=4, num_host_blocks=32, decode_lanes=8, prefill_seconds=0.05
    )
    agents = create_requests(2, prompt_len=4, max_tokens=40, request_class="agent")
    for r in agents:
        sched.add_request(r)
        step(sched, backend, clock)  # the second prefills beside the first's round: a debt the burst waits on
    for _ in range(8):
        step(sched, backend, clock)  # 14 and 13 tokens: 4 pages each
    burst = create_requests(3, prompt_len=8, max_tokens=6, start=2)
    for r in burst:
        sched.add_request(r)
    preempted_in_group = False
    by_request: dict = {}
    for _ in range(400):
        if not sched.has_work:
            break
        before = sched.counters["preempted"]
        waiting_group = bool(sched.joined)
        for o in step(sched, backend, clock):
            by_request.setdefault(o.request_id, []).append(o)
        preempted_in_group |= waiting_group and sched.counters["preempted"] > before
        if backend.plans[-1].is_empty:
            clock.advance(0.01)
    assert preempted_in_group
    for r in burst:
        assert tokens_of(by_request[r.request_id]) == expected_tokens(r, 6)
    for r, sent in zip(agents, (10, 9)):
        assert tokens_of(by_request[r.request_id]) == expected_tokens(r, 40)[sent:]
    assert_pool_drained(sched)


def test_a_burst_sharing_a_system_prompt_still_claims_it():
    sched, backend, clock = create_scheduler(prefill_chunk=64, num_blocks=64, block_size=4, decode_lanes=8)
    system = list(range(500, 513))
    burst = create_requests(3, prompt_len=20, prefix=system)
    others = create_requests(2, prompt_len=9, start=5)
    for r in burst[:1] + others + burst[1:]:
        sched.add_request(r)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.prefills] == [0, 1, 2]  # the system prompt's owner and the unrelated two
    sched.update_from_output(plan, backend.step(plan))
    plan = sched.schedule()
    assert [(s.seq_id, s.start_pos) for s in plan.prefills] == [(3, 12), (4, 12)]  # the rest claim its 3 blocks
