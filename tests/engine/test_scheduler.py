"""Scheduler invariants, driven by a fake backend that returns scripted tokens."""

from __future__ import annotations

import pytest

from engine.messages import AddRequest, RequestFailed, TokenEvent
from engine.sequence import SequenceStatus
from tests.engine.fake_backend import (
    FakeBackend,
    create_requests,
    create_scheduler,
    finished_of,
    run_until_done,
    step,
    tokens_of,
)


def expected_tokens(req: AddRequest, n: int) -> list[int]:
    """What an undisturbed run produces: the fake's next-token chain."""
    ctx = list(req.prompt_token_ids)
    for _ in range(n):
        ctx.append(FakeBackend.next_token(ctx))
    return ctx[len(req.prompt_token_ids) :]


def assert_pool_drained(sched) -> None:
    sched.kv.end_step()
    u = sched.kv.usage()
    assert u["used"] == 0 and u["host_used"] == 0
    assert sched.kv.num_available_blocks == u["total"]  # pinned prefixes included: they only go last
    assert not sched.has_work and sched.make_stats().lanes_busy == 0


def test_requests_complete_with_expected_tokens_and_free_blocks():
    sched, backend, clock = create_scheduler()
    reqs = create_requests(3, prompt_len=10, max_tokens=6)
    for r in reqs:
        assert sched.add_request(r) is None
    msgs = run_until_done(sched, backend, clock)
    for r in reqs:
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, 6)
        done = finished_of(msgs[r.request_id])
        assert done.finish_reason == "length"
        assert (done.prompt_tokens, done.completion_tokens) == (10, 6)
    assert_pool_drained(sched)


def test_first_event_carries_ttft_only():
    sched, backend, clock = create_scheduler(prefill_seconds=0.01)
    (r,) = create_requests(1, max_tokens=3)
    sched.add_request(r)
    events = [m for m in run_until_done(sched, backend, clock)[r.request_id] if isinstance(m, TokenEvent)]
    assert events[0].ttft == pytest.approx(0.1)  # 10 prompt tokens at 0.01 s
    assert all(e.ttft is None for e in events[1:])


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 4])
def test_blocks_freed_after_abort(abort_after_steps):
    sched, backend, clock = create_scheduler(prefill_chunk=4)
    reqs = create_requests(2, prompt_len=10, max_tokens=20)
    for r in reqs:
        sched.add_request(r)
    for _ in range(abort_after_steps):
        step(sched, backend, clock)
    out = sched.finish_requests([reqs[0].request_id], SequenceStatus.FINISHED_ABORTED)
    assert [(m.request_id, m.finish_reason) for m in out] == [(reqs[0].request_id, "abort")]
    assert sched.finish_requests(reqs[0].request_id, SequenceStatus.FINISHED_ABORTED) == []
    assert sched.finish_requests(["nobody"], SequenceStatus.FINISHED_ABORTED) == []
    assert sched.make_stats().aborted == 1
    msgs = run_until_done(sched, backend, clock)
    assert reqs[0].request_id not in msgs
    assert tokens_of(msgs[reqs[1].request_id]) == expected_tokens(reqs[1], 20)
    assert_pool_drained(sched)


def test_abort_while_plan_in_flight_is_ignored_by_update():
    sched, backend, clock = create_scheduler(prefill_chunk=4)
    (r,) = create_requests(1, prompt_len=10)
    sched.add_request(r)
    plan = sched.schedule()
    out = backend.step(plan)
    sched.finish_requests([r.request_id], SequenceStatus.FINISHED_ABORTED)
    assert sched.update_from_output(plan, out) == []
    assert_pool_drained(sched)


def test_prefill_chunk_budget_never_exceeded():
    sched, backend, clock = create_scheduler(prefill_chunk=8, max_context=512, num_blocks=128, decode_lanes=8)
    reqs = create_requests(3, prompt_len=37, max_tokens=4) + create_requests(2, prompt_len=5, start=3)
    for r in reqs:
        sched.add_request(r)
    msgs = run_until_done(sched, backend, clock)
    spans = [p.prefill for p in backend.plans if p.prefill is not None]
    assert spans and all(len(s.token_ids) <= 8 for s in spans)
    assert sum(len(s.token_ids) for s in spans) == 3 * 37 + 2 * 5
    assert all(s.sample is not None for s in spans if s.start_pos + len(s.token_ids) in (37, 5))
    for r in reqs:
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, r.max_tokens)


def test_decode_share_wait_between_chunks():
    sched, backend, clock = create_scheduler(prefill_chunk=10, decode_share=0.25, max_context=512, num_blocks=128)
    first, long_prompt = create_requests(1, prompt_len=4, max_tokens=100) + create_requests(1, prompt_len=40, start=1)
    sched.add_request(first)
    step(sched, backend, clock)  # prefill, first token: now a lane decodes
    sched.add_request(long_prompt)
    plan = sched.schedule()
    assert plan.prefill is not None and plan.decode
    out = backend.step(plan)
    out.prefill_seconds = 0.3  # the chunk took 0.3 s: the next waits 0.3 * 0.25 / 0.75 = 0.1 s
    sched.update_from_output(plan, out)
    assert sched.prefill_wait() == pytest.approx(0.1)  # what the worker's loop would wait, were the plan empty
    for dt in (0.0, 0.05, 0.049):
        clock.advance(dt)
        plan = sched.schedule()
        assert plan.prefill is None and len(plan.decode) == 1
        sched.update_from_output(plan, backend.step(plan))
    assert sched.prefill_wait() == pytest.approx(0.001)
    clock.advance(0.002)
    plan = sched.schedule()
    assert plan.prefill is not None and plan.prefill.start_pos == 10
    assert sched.prefill_wait() == 0.0


def test_a_whole_prompt_is_not_held_for_its_own_estimate():
    """While a lane decodes, a prompt longer than a chunk waits its first chunk's estimated share
    before it starts; one that is whole in its chunk starts at once (only a debt would hold it).
    The estimate is the rate of the last chunk of at least half a chunk: a launch-bound few-token
    chunk (here 4 tokens in 0.2 s) does not inflate it."""
    sched, backend, clock = create_scheduler(prefill_chunk=32, decode_share=0.25, max_context=512, num_blocks=128)
    lane, warm, short, tiny, long_prompt = (
        create_requests(1, prompt_len=4, max_tokens=200)
        + create_requests(1, prompt_len=32, max_tokens=1, start=1)
        + create_requests(1, prompt_len=20, max_tokens=1, start=2)
        + create_requests(1, prompt_len=4, max_tokens=1, start=3)
        + create_requests(1, prompt_len=64, start=4)
    )

    def prefill_step(req, seconds):
        sched.add_request(req)
        clock.advance(10.0)  # every debt paid
        plan = sched.schedule()
        assert plan.prefill is not None and plan.decode, "held"
        out = backend.step(plan)
        out.prefill_seconds = seconds
        sched.update_from_output(plan, out)

    sched.add_request(lane)
    step(sched, backend, clock)  # now a lane decodes
    prefill_step(warm, 0.32)  # a full chunk: 0.01 s a token
    prefill_step(short, 0.2)  # whole in its chunk: not held, though its estimate is 0.2 s
    prefill_step(tiny, 0.2)  # 4 tokens in 0.2 s: too small a chunk to say a rate
    sched.add_request(long_prompt)
    clock.advance(10.0)
    assert sched.schedule().prefill is None  # two chunks: its first waits 32 x 0.01 x 0.25 / 0.75
    assert sched.prefill_wait() == pytest.approx(0.32 / 3)


def test_prompt_with_no_lane_decoding_waits_for_nothing():
    sched, backend, clock = create_scheduler(prefill_chunk=10, max_context=512, num_blocks=128)
    (r,) = create_requests(1, prompt_len=40)
    sched.add_request(r)
    for start in (0, 10, 20, 30):
        plan = sched.schedule()
        assert plan.prefill.start_pos == start
        out = backend.step(plan)
        out.prefill_seconds = 1.0
        sched.update_from_output(plan, out)  # the clock does not move
        assert sched.prefill_wait() is None  # no lane decodes: the gate never holds a chunk


def test_share_holds_over_a_long_prefill():
    share = 0.25
    sched, backend, clock = create_scheduler(
        prefill_chunk=16,
        decode_share=share,
        max_context=2048,
        num_blocks=512,
        prefill_seconds=0.001,
        decode_seconds=0.004,
    )
    lane, long_prompt = create_requests(1, prompt_len=4, max_tokens=1000) + create_requests(
        1, prompt_len=640, max_tokens=1, start=1
    )
    sched.add_request(lane)
    step(sched, backend, clock)
    sched.add_request(long_prompt)
    t0, decode_time = clock(), 0.0
    while sched.sequence(1) is not None:
        plan = sched.schedule()
        decode_time += 0.004 if plan.decode else 0.0
        out = backend.step(plan)
        clock.advance(out.prefill_seconds + out.decode_seconds)
        sched.update_from_output(plan, out)
    assert decode_time / (clock() - t0) == pytest.approx(share, abs=0.05)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_share_holds_over_a_two_chunk_prompt(share):
    """A prompt that takes the prefill lane while lanes decode waits before its first
    chunk too, so over its own prefill the lanes keep the share, not (n-1)/n of it."""
    sched, backend, clock = create_scheduler(
        prefill_chunk=320, decode_share=share, max_context=2048, num_blocks=512, prefill_seconds=0.001,
        decode_seconds=0.004,
    )  # fmt: skip
    (lane,) = create_requests(1, prompt_len=4, max_tokens=1000, start=9)
    warm, prompt = create_requests(2, prompt_len=640, max_tokens=1)
    for r in (lane, warm):  # warm: the scheduler has seen a chunk's rate
        sched.add_request(r)
    while sched.sequence(1) is not None:
        step(sched, backend, clock)
    for _ in range(10):  # the lanes alone a while: part of the last prompt's debt paid
        step(sched, backend, clock)
    sched.add_request(prompt)
    t0, decode_time = clock(), 0.0
    while sched.sequence(2) is not None:
        plan = sched.schedule()
        decode_time += 0.004 if plan.decode else 0.0
        out = backend.step(plan)
        clock.advance(out.prefill_seconds + out.decode_seconds)
        sched.update_from_output(plan, out)
    assert decode_time / (clock() - t0) == pytest.approx(share, abs=0.04)


def test_prefix_hit_skips_shared_full_blocks():
    sched, backend, clock = create_scheduler(block_size=4, prefill_chunk=64)
    shared = list(range(500, 513))  # 3 full blocks + 1 token
    a, b = create_requests(2, prompt_len=20, max_tokens=5, prefix=shared)
    sched.add_request(a)
    run_until_done(sched, backend, clock)
    sched.add_request(b)
    msgs = run_until_done(sched, backend, clock)[b.request_id]
    spans = [p.prefill for p in backend.plans if p.prefill is not None]
    assert spans[-1].start_pos == 12 and len(spans[-1].token_ids) == 8
    assert tokens_of(msgs) == expected_tokens(b, 5)  # the claimed blocks hold the right K/V
    assert finished_of(msgs).cached_tokens == 12
    assert all(m.cached_tokens == 12 for m in msgs if isinstance(m, TokenEvent))
    stats = sched.make_stats()
    assert stats.prefix_hits == 1 and stats.cached_tokens == 12


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_burst_shares_its_system_block_and_a_pin_outlives_a_flood(shared_prefix):
    """A burst of subagents claims the first one's system blocks while it is still
    live; marked as a shared prefix, the block then survives traffic that evicts
    every other retained page, so the next burst skips it too."""
    sched, backend, clock = create_scheduler(num_blocks=24, block_size=4, prefill_chunk=64, decode_lanes=4)
    system = list(range(500, 513))  # 3 full blocks + 1 token
    kw = {"shared_prefix_len": len(system)} if shared_prefix else {}
    burst = create_requests(4, prompt_len=20, max_tokens=5, prefix=system, **kw)
    for r in burst:
        assert sched.add_request(r) is None
    done = run_until_done(sched, backend, clock)
    cached = [finished_of(done[r.request_id]).cached_tokens for r in burst]
    assert cached == [0, 12, 12, 12]  # live sharing: no pin needed within a burst
    assert sched.kv.usage()["pinned"] == (3 if shared_prefix else 0)
    for flood in create_requests(6, prompt_len=20, max_tokens=5, start=100):  # 30 retained blocks > the pool
        sched.add_request(flood)
        run_until_done(sched, backend, clock)
    (late,) = create_requests(1, prompt_len=20, max_tokens=5, prefix=system, start=50, **kw)
    sched.add_request(late)
    msgs = run_until_done(sched, backend, clock)[late.request_id]
    assert finished_of(msgs).cached_tokens == (12 if shared_prefix else 0)
    assert tokens_of(msgs) == expected_tokens(late, 5)
    assert_pool_drained(sched)


def test_identical_prompt_recomputes_its_last_token():
    sched, backend, clock = create_scheduler(block_size=4)
    (a,) = create_requests(1, prompt_len=12, max_tokens=3)
    sched.add_request(a)
    run_until_done(sched, backend, clock)
    again = AddRequest("again", "chan-again", list(a.prompt_token_ids), 3)
    sched.add_request(again)
    msgs = run_until_done(sched, backend, clock)["again"]
    assert finished_of(msgs).cached_tokens == 8
    assert tokens_of(msgs) == expected_tokens(a, 3)


def test_interactive_ranks_above_agent():
    sched, backend, clock = create_scheduler(prefill_chunk=4)
    agent = create_requests(1, request_class="agent")[0]
    interactive = create_requests(1, start=1)[0]
    sched.add_request(agent)
    sched.add_request(interactive)
    plan = sched.schedule()
    assert plan.prefill.seq_id == sched.seqs[interactive.request_id].seq_id
    msgs = run_until_done(sched, backend, clock)
    assert finished_of(msgs[agent.request_id]).finish_reason == "length"
    assert sched.make_stats().admitted == 2


def test_preempted_request_resumes_identically():
    # 12 blocks of 4 slots: the agent (prompt 16 + 24 tokens) fills most of the pool by
    # the time the interactive request (prompt 20) arrives, so the agent moves to host.
    sched, backend, clock = create_scheduler(
        num_blocks=12, block_size=4, num_host_blocks=16, max_context=48, prefill_chunk=32
    )
    (agent,) = create_requests(1, prompt_len=16, max_tokens=24, request_class="agent")
    (inter,) = create_requests(1, prompt_len=20, max_tokens=12, start=1)
    sched.add_request(agent)
    msgs: dict[str, list[dict]] = {}
    for _ in range(12):
        for m in step(sched, backend, clock):
            msgs.setdefault(m.request_id, []).append(m)
    sched.add_request(inter)
    for rid, ms in run_until_done(sched, backend, clock).items():
        msgs.setdefault(rid, []).extend(ms)
    assert any(p.swap_out for p in backend.plans) and any(p.swap_in for p in backend.plans)
    assert sched.make_stats().preempted >= 1 and sched.make_stats().recomputed == 0
    assert tokens_of(msgs[agent.request_id]) == expected_tokens(agent, 24)
    assert tokens_of(msgs[inter.request_id]) == expected_tokens(inter, 12)
    assert_pool_drained(sched)


def test_preempted_when_host_full_recomputes_identically():
    sched, backend, clock = create_scheduler(
        num_blocks=12, block_size=4, num_host_blocks=0, max_context=48, prefill_chunk=32
    )
    (agent,) = create_requests(1, prompt_len=16, max_tokens=24, request_class="agent")
    (inter,) = create_requests(1, prompt_len=20, max_tokens=12, start=1)
    sched.add_request(agent)
    msgs: dict[str, list[dict]] = {}
    for _ in range(12):
        for m in step(sched, backend, clock):
            msgs.setdefault(m.request_id, []).append(m)
    sched.add_request(inter)
    for rid, ms in run_until_done(sched, backend, clock).items():
        msgs.setdefault(rid, []).extend(ms)
    assert sched.make_stats().recomputed >= 1
    assert tokens_of(msgs[agent.request_id]) == expected_tokens(agent, 24)
    assert tokens_of(msgs[inter.request_id]) == expected_tokens(inter, 12)
    assert_pool_drained(sched)


def test_many_requests_under_memory_pressure_all_match():
    sched, backend, clock = create_scheduler(
        num_blocks=20, block_size=4, num_host_blocks=24, decode_lanes=6, max_context=64, prefill_chunk=8
    )
    reqs = create_requests(3, prompt_len=9, max_tokens=30, request_class="agent") + create_requests(
        3, prompt_len=13, max_tokens=25, start=3
    )
    for r in reqs:
        assert sched.add_request(r) is None
    msgs = run_until_done(sched, backend, clock)
    for r in reqs:
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, r.max_tokens)
    assert sched.make_stats().preempted >= 1
    assert_pool_drained(sched)


def test_engine_full_with_retry_after():
    sched, backend, clock = create_scheduler(decode_lanes=2, decode_seconds=0.05)
    reqs = create_requests(3, max_tokens=10)
    assert sched.add_request(reqs[0]) is None and sched.add_request(reqs[1]) is None
    refused = sched.add_request(reqs[2])
    assert isinstance(refused, RequestFailed)
    assert (refused.code, refused.status, refused.retry_after) == ("engine_full", 503, 1.0)
    for _ in range(3):
        step(sched, backend, clock)
    sched.cfg.retry_after_floor = 0.1
    refused = sched.add_request(reqs[2])
    remaining = min(s.num_remaining_tokens for s in sched.seqs.values())
    assert refused.retry_after == pytest.approx(remaining * 0.05)
    decide = AddRequest("d", "chan-d", [1, 2, 3], 0, decide=True)
    assert sched.add_request(decide) is None  # decide takes only the prefill lane
    msgs = run_until_done(sched, backend, clock)
    done = finished_of(msgs["d"])
    assert done.logits == [3.0, 4.0, 5.0, 6.0] and done.completion_tokens == 0
    assert sched.add_request(reqs[2]) is None


def test_context_length_exceeded():
    sched, _, _ = create_scheduler(max_context=32, num_blocks=6, block_size=4)
    (too_long,) = create_requests(1, prompt_len=33)
    (at_limit,) = create_requests(1, prompt_len=32, start=1)
    for r in (too_long, at_limit):
        failed = sched.add_request(r)
        assert (failed.code, failed.status, failed.error_type, failed.param) == (
            "context_length_exceeded",
            400,
            "invalid_request_error",
            "messages",
        )
    (too_big_for_pool,) = create_requests(1, prompt_len=20, max_tokens=10, start=2)  # 30 tokens > 24 slots
    assert sched.add_request(too_big_for_pool).code == "context_length_exceeded"
    assert sched.add_request(create_requests(1, prompt_len=20, max_tokens=4, start=3)[0]) is None


def test_max_tokens_clamped_to_context():
    sched, backend, clock = create_scheduler(max_context=16, num_blocks=8)
    (r,) = create_requests(1, prompt_len=12, max_tokens=100)
    sched.add_request(r)
    done = finished_of(run_until_done(sched, backend, clock)[r.request_id])
    assert (done.finish_reason, done.completion_tokens) == ("length", 4)


def test_stop_token_finishes_without_streaming_it():
    (r,) = create_requests(1, max_tokens=10)
    stop = expected_tokens(r, 3)[2]
    r.stop_token_ids = [stop]
    sched, backend, clock = create_scheduler()
    sched.add_request(r)
    msgs = run_until_done(sched, backend, clock)[r.request_id]
    assert tokens_of(msgs) == expected_tokens(r, 2)
    done = finished_of(msgs)
    assert (done.finish_reason, done.completion_tokens) == ("stop", 3)
    assert_pool_drained(sched)


def test_unseeded_requests_get_a_seed_seeded_keep_theirs():
    sched, _, _ = create_scheduler()
    a, b = create_requests(2)
    b.sampling = {"seed": 42, "temperature": 0.7}
    sched.add_request(a)
    sched.add_request(b)
    assert isinstance(sched.seqs[a.request_id].seed, int)
    assert sched.seqs[b.request_id].seed == 42
    plan = sched.schedule()
    assert plan.prefill.sample is None or plan.prefill.sample.seed in (42, sched.seqs[a.request_id].seed)


def test_stats_shape():
    sched, backend, clock = create_scheduler(decode_seconds=0.02)
    for r in create_requests(2, max_tokens=50) + create_requests(1, request_class="agent", start=2):
        sched.add_request(r)
    for _ in range(4):
        step(sched, backend, clock)
    st = sched.make_stats()
    assert st.lanes_busy == 3 and st.lanes_total == 4
    assert st.requests_by_class == {"interactive": 2, "agent": 1}
    assert sum(st.requests_by_state.values()) == 3
    assert st.kv_pages["used"] > 0 and st.round_seconds == pytest.approx(0.02)
    assert st.decoded_tokens > 0 and st.prefilled_tokens == 30
    assert sched.sequence(0).status == SequenceStatus.DECODING


def assert_books_consistent(sched) -> None:
    kv = sched.kv
    held: dict[int, int] = {}
    for seq in sched.seqs.values():
        for b in seq.block_table:
            held[b] = held.get(b, 0) + 1
        assert len(seq.block_table) == 0 or seq.status in (SequenceStatus.PREFILLING, SequenceStatus.DECODING)
    assert all(kv.ref_count[b] == held.get(b, 0) for b in range(kv.num_blocks))
    free, evictable = set(kv.free_blocks), set(kv.evictable)
    assert len(free) == len(kv.free_blocks) and not free & evictable
    assert all(kv.ref_count[b] == 0 and kv.hashes[b] is None for b in free)
    assert all(kv.ref_count[b] == 0 and kv.hashes[b] is not None for b in evictable)
    live = {b for b in range(kv.num_blocks) if kv.ref_count[b] > 0 or kv.pins[b] > 0}
    assert free | evictable | live == set(range(kv.num_blocks))
    host_held = [h for seq in sched.seqs.values() for h in seq.host_block_table]
    assert len(set(host_held)) == len(host_held) and not set(host_held) & set(kv.free_host_blocks)
    in_flight = kv.host_blocks_in_flight
    assert len(host_held) + len(kv.free_host_blocks) + len(in_flight) == kv.num_host_blocks


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_books_and_outputs(seed):
    import random

    rng = random.Random(seed)
    sched, backend, clock = create_scheduler(
        num_blocks=24,
        block_size=4,
        num_host_blocks=rng.choice([0, 8, 32]),
        decode_lanes=5,
        max_context=64,
        prefill_chunk=rng.choice([4, 8, 32]),
    )
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    pending = [
        create_requests(
            1,
            prompt_len=rng.randint(2, 30),
            max_tokens=rng.randint(1, 30),
            start=i,
            request_class=rng.choice(["interactive", "agent"]),
            prefix=shared if i % 3 == 0 else (),
        )[0]
        for i in range(25)
    ]
    admitted, aborted, msgs = {}, set(), {}
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            r = pending.pop()
            if sched.add_request(r) is None:
                admitted[r.request_id] = r
        if sched.seqs and rng.random() < 0.03:
            rid = rng.choice(sorted(sched.seqs))
            aborted.add(rid)
            sched.finish_requests([rid], SequenceStatus.FINISHED_ABORTED)
        for m in step(sched, backend, clock):
            msgs.setdefault(m.request_id, []).append(m)
        assert_books_consistent(sched)
        if not pending and not sched.has_work:
            break
    assert not sched.has_work
    for rid, r in admitted.items():
        if rid in aborted:
            continue
        done = finished_of(msgs[rid])
        assert tokens_of(msgs[rid]) == expected_tokens(r, done.completion_tokens)
        assert done.completion_tokens == min(r.max_tokens, 64 - len(r.prompt_token_ids))
    assert_pool_drained(sched)
