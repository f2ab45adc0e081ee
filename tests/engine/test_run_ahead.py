"""Rounds planned ahead (engine/run_ahead.py, model.async_rounds): round N+1 planned and run
before round N's output is taken in gives the tokens and the KV books of the synchronous loop,
lanes finishing by length, by a stop token or by an abort in the middle included; the worker
runs them on a backend that can, and stops at once when the key is turned off."""

from __future__ import annotations

import random

import pytest

from engine.backend import PENDING
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import ENGINE_CHANNEL, AbortRequest, AddRequest, ConfigureEngine, RequestFinished, TokenEvent
from engine.run_ahead import plan_ahead
from engine.scheduler import Scheduler
from tests.engine import test_spec_model
from tests.engine.fake_backend import VOCAB, FakeBackend, FakeClock, tokens_of
from tests.engine.test_scheduler import assert_pool_drained, expected_tokens


def drive(sched, backend, *, ahead: bool, between=None, clock=None, defer: bool = False):
    """The worker's loop (engine/worker.py ``_run_rounds``) without an event loop: a round planned
    ahead is planned and stepped before the round before it has its output taken in, as on the
    step thread. ``between(sched, n)`` runs after round n's output is in (an abort arriving while
    the next round computes). Returns the outputs by request, how many rounds ran ahead, and the
    books at each point where a round's output is in and the next round is planned. ``defer``:
    steps run with ``defer=True`` and a round's output is finished after the next one is queued
    (the worker's order on a backend that defers rounds)."""
    outputs: dict[str, list] = {}
    books: list[tuple] = []
    num_ahead = n = 0

    def take(outs):
        for o in outs:
            outputs.setdefault(o.request_id, []).append(o)

    def schedule():
        while sched.has_work:
            plan = sched.schedule()
            if not plan.is_empty:
                return plan
            clock.advance(0.01)  # the worker would wait for the prefill gate
        return None

    def step(plan):
        return backend.step(plan, defer=True) if defer else backend.step(plan)

    plan = schedule()
    out = step(plan)
    while True:
        nxt = plan_ahead(sched, plan) if ahead else None
        nxt_out = step(nxt) if nxt is not None else None  # behind ``plan`` on the step thread
        out = backend.finish(out)
        take(sched.update_from_output(plan, out))
        n += 1
        if between is not None:
            take(between(sched, n))
        if nxt is None:
            nxt = schedule()
            nxt_out = step(nxt) if nxt is not None else None
        else:
            num_ahead += 1
        now = snapshot(sched, nxt)
        if not books or books[-1] != now:  # a round whose rows were all thrown away (its lanes finished
            books.append(now)  # in the round before) leaves the books as they were
        if nxt is None:
            return outputs, num_ahead, books
        plan, out = nxt, nxt_out


def snapshot(sched, plan) -> tuple:
    """What must agree between the two loops (block ids may differ: the order pages are taken in)."""
    live = {s.request_id: (len(s.block_table), s.num_computed_tokens, s.num_tokens) for s in sched.seqs.values()}
    usage = sched.kv.usage()
    rows = sorted((ln.seq_id, ln.position) for ln in plan.decode if ln.seq_id in sched.by_seq_id) if plan else []
    return live, usage, sorted(sched.kv.hash_to_block), rows


def requests(n: int, stops: bool = True) -> list[AddRequest]:
    """Prompts of different lengths and caps; every third stops on a token it draws halfway."""
    out = []
    for i in range(n):
        prompt = [(i * 31 + j * 7) % VOCAB for j in range(6 + 3 * i)]
        add = AddRequest(f"req-{i}", f"chan-{i}", prompt, 4 + (5 * i) % 9)
        if stops and i % 3 == 1:
            add.stop_token_ids = [expected_tokens(add, add.max_tokens)[add.max_tokens // 2]]
        out.append(add)
    return out


def scheduler(num_blocks: int = 64, lanes: int = 8):
    cfg = EngineConfig(decode_lanes=lanes, prefill_chunk=16, max_context=256, block_size=4, default_max_tokens=16)
    clock = FakeClock()
    sched = Scheduler(cfg, KVManager(num_blocks, 4, 64), clock=clock, seed_rng=random.Random(0))
    return sched, FakeBackend(num_blocks, 4, 64), clock


def run_both(reqs, between=None, num_blocks: int = 64):
    got = []
    for ahead in (False, True):
        sched, backend, clock = scheduler(num_blocks)
        for r in reqs:
            assert sched.add_request(r) is None
        got.append((*drive(sched, backend, ahead=ahead, between=between, clock=clock), sched))
    return got


@pytest.mark.parametrize("width", [1, 3, 8])
def test_rounds_planned_ahead_give_the_same_tokens_and_books(width):
    (sync, n_sync, books_sync, s1), (ahead, n_ahead, books_ahead, s2) = run_both(requests(width))
    assert n_sync == 0 and n_ahead > 0  # the second loop did plan rounds ahead
    for rid, outs in sync.items():
        assert tokens_of(ahead[rid]) == tokens_of(outs)
        assert [o for o in ahead[rid] if isinstance(o, RequestFinished)] == [
            o for o in outs if isinstance(o, RequestFinished)
        ]
    stopped = [
        o for outs in sync.values() for o in outs if isinstance(o, RequestFinished) and o.finish_reason == "stop"
    ]
    assert stopped or width == 1  # a lane finished by a stop token while its next round was planned
    assert books_ahead == books_sync  # pages, computed positions, prefix hashes, rows: at every round
    assert_pool_drained(s1)
    assert_pool_drained(s2)


def test_an_abort_while_a_round_runs_ahead_frees_what_sync_frees():
    def abort(sched, n):
        return sched.finish_requests(["req-2", "req-5"], _aborted()) if n == 12 else []

    (sync, _, books_sync, s1), (ahead, n_ahead, books_ahead, s2) = run_both(requests(8), between=abort)
    assert n_ahead > 0
    assert books_ahead == books_sync
    for rid in sync:
        assert tokens_of(ahead[rid]) == tokens_of(sync[rid])
    assert [o.finish_reason for o in ahead["req-5"] if isinstance(o, RequestFinished)] == ["abort"]
    assert_pool_drained(s2)


def test_a_dry_pool_preempts_as_the_synchronous_loop_does():
    reqs = [AddRequest(f"req-{i}", "c", [(i * 13 + j) % VOCAB for j in range(10)], 14) for i in range(6)]
    (sync, _, books_sync, s1), (ahead, n_ahead, books_ahead, s2) = run_both(reqs, num_blocks=20)
    assert s1.make_stats().preempted > 0 and n_ahead > 0
    assert s2.make_stats().preempted == s1.make_stats().preempted
    assert books_ahead == books_sync
    for r in reqs:
        assert tokens_of(ahead[r.request_id]) == expected_tokens(r, 14)
    assert_pool_drained(s2)


def test_a_reasoning_channel_opened_mid_run_is_taken_back_as_sync_does():
    """Each lane's thinking opens on a token it draws (rounds run ahead until then), then its budget
    of 2 is spent and the thinking is taken back and closed (those rounds are synchronous)."""
    reqs = requests(4, stops=False)
    for r in reqs:
        r.max_tokens = 14
        start = expected_tokens(r, 14)[8]
        r.reasoning = {"start_ids": [[start]], "end_ids": [[VOCAB + 1]], "close_ids": [7, 8], "max_tokens": 2}
    (sync, _, books_sync, s1), (ahead, n_ahead, books_ahead, s2) = run_both(reqs)
    assert n_ahead > 0 and s1.loop_guard_fired == s2.loop_guard_fired == {"budget": 4}
    assert books_ahead == books_sync
    for r in reqs:
        assert [(o.token_ids, o.taken_back) for o in ahead[r.request_id] if isinstance(o, TokenEvent)] == [
            (o.token_ids, o.taken_back) for o in sync[r.request_id] if isinstance(o, TokenEvent)
        ]
    assert_pool_drained(s2)


def _aborted():
    from engine.sequence import SequenceStatus

    return SequenceStatus.FINISHED_ABORTED


def _decoding(reqs, **cfg_kw):
    """A scheduler whose lanes all decode, and the plain decode round it planned next."""
    sched, backend, clock = scheduler()
    for k, v in cfg_kw.items():
        setattr(sched.cfg, k, v)
    for r in reqs:
        assert sched.add_request(r) is None
    while sched.waiting or sched.prefilling is not None:
        plan = sched.schedule()
        sched.update_from_output(plan, backend.step(plan))
    return sched, sched.schedule()


def test_what_cannot_run_ahead_keeps_the_round_synchronous():
    plain = requests(2, stops=False)
    sched, plan = _decoding(plain)
    ahead = plan_ahead(sched, plan)
    assert ahead is not None and [ln.token_id for ln in ahead.decode] == [PENDING, PENDING]
    assert [ln.position for ln in ahead.decode] == [s.num_tokens for s in sched.running]
    penalised = requests(2, stops=False)
    penalised[1].sampling = {"repetition_penalty": 1.2}
    sched, plan = _decoding(penalised)
    assert plan_ahead(sched, plan) is None  # the penalty needs round N's token on the host
    sched, plan = _decoding(requests(2, stops=False))
    sched.add_request(requests(3, stops=False)[2])
    assert plan_ahead(sched, plan) is None  # a prompt waits: the synchronous schedule admits it
    sched, plan = _decoding(requests(2, stops=False))
    sched.max_round_rows = 16  # rows to spare for drafts, speculation on: drafts need N's token
    assert plan_ahead(sched, plan) is None


def test_a_lane_whose_round_commits_its_last_token_gets_no_row_ahead():
    reqs = requests(2, stops=False)
    sched, plan = _decoding(reqs)
    last = sched.running[0]
    last.max_tokens = last.num_generated + 1
    ahead = plan_ahead(sched, plan)
    assert [ln.seq_id for ln in ahead.decode] == [sched.running[1].seq_id]


# -- the worker --------------------------------------------------------------------------


def on_new_backends(models, change) -> None:
    """``change(backend)`` on every fake backend ``models`` makes from now on."""
    make = models.create_backend

    def create_backend(name, config=None):
        backend = make(name, config)
        change(backend)
        return backend

    models.create_backend = create_backend


def pending_steps(models) -> list[bool]:
    """Per decode step the fake backends ``models`` makes from now on run: whether a row fed PENDING."""
    seen: list[bool] = []

    def record_pending(backend):
        before = backend.before_step

        def record(plan):
            if plan.decode:
                seen.append(any(ln.token_id == PENDING for ln in plan.decode))
            before(plan)

        backend.before_step = record

    on_new_backends(models, record_pending)
    return seen


async def three_streams_end_by_length(eng) -> None:
    """Three requests of 12 tokens each come back whole: the fake's tokens, finish_reason length."""
    from tests.engine.test_worker import expected

    adds = [await eng.submit(max_tokens=12) for _ in range(3)]
    for add in adds:
        tokens, last = await eng.outcome(add)
        assert tokens == expected(add, 12) and last["finish_reason"] == "length"


def test_the_worker_runs_rounds_ahead_and_the_key_turns_them_off_live(models):
    from tests.engine.test_worker import Engine, expected, run

    seen = pending_steps(models)

    async def scenario():
        async with Engine(models, models.model("m1")) as eng:
            await three_streams_end_by_length(eng)
            assert any(seen)
            reply = await eng.layer.new_channel()
            off = ConfigureEngine({"async_rounds": False}, reply_channel=reply)
            await eng.layer.send(ENGINE_CHANNEL, off.to_message())
            await eng.receive(reply)
            seen.clear()
            adds = [await eng.submit(max_tokens=12) for _ in range(3)]
            for add in adds:
                tokens, _ = await eng.outcome(add)
                assert tokens == expected(add, 12)
            assert seen and not any(seen)

    run(scenario)


def test_the_worker_reads_a_deferred_round_back_after_queueing_the_next(models):
    """A backend that defers rounds (a GPU's: Backend.defers_rounds) hands round N back queued; the
    worker queues N+1 on the step thread before it asks for N's tokens (``finish``), and every
    token is the synchronous run's."""
    from tests.engine.test_worker import Engine, run

    on_new_backends(models, lambda backend: setattr(backend, "defers_rounds", True))

    async def scenario():
        async with Engine(models, models.model("m1")) as eng:
            await three_streams_end_by_length(eng)

    run(scenario)
    calls = models.backends[-1].calls
    finished = [n for kind, n in calls if kind == "finish"]
    assert finished, calls
    # Round n was read back only after round n + 1 was stepped (queued behind it), for most rounds.
    at = {call: i for i, call in enumerate(calls)}
    later = [n for n in finished if at.get(("step", n + 1), len(calls)) < at[("finish", n)]]
    assert len(later) >= len(finished) // 2, calls
    assert all(at[("step", n)] < at[("finish", n)] for n in finished)


def test_a_round_ahead_that_raises_ends_only_its_failing_lane(models):
    """The poisoned lane's rounds raise from its fourth token on, in rounds planned ahead (rows fed
    PENDING) with one more queued behind them: that lane ends with engine_error, the queued round is
    thrown away, and the other lanes stream every token they would alone."""
    from tests.engine.test_worker import Engine, expected, refused_with, run

    failed_ahead: list[bool] = []

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            models.step_gate.close()
            adds = [await e.submit(max_tokens=12, sampling={"top_k": k}) for k in (0, 7, 0)]
            bad = adds[1]

            def fails(plan):
                hit = any(ln.sample.params.top_k == 7 and ln.position >= len(bad.prompt_token_ids) + 2
                          for ln in plan.decode)  # fmt: skip
                if hit:
                    failed_ahead.append(any(ln.token_id == PENDING for ln in plan.decode))
                return hit

            models.fail_step = fails
            models.step_gate.open()
            tokens, last = await e.outcome(bad)
            assert refused_with(last, "engine_error", 500) and tokens == expected(bad, 3)
            for add in (adds[0], adds[2]):
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and tokens == expected(add, 12)
            stats = (await e.status())["stats"]
            assert (stats["aborted"], stats["lanes_busy"], stats["kv_pages"]["used"]) == (1, 0, 0)

    run(scenario)
    assert failed_ahead[0]  # the round that raised first was one planned ahead


def test_an_abort_while_a_round_ahead_is_held_frees_its_lane_and_pages(models):
    """A round planned ahead is held on the step thread (one more may be queued behind it) when
    an abort arrives: the aborted lane ends at once with what it streamed, the rounds already
    planned with its row throw that row away, and the books end empty."""
    from tests.engine.test_worker import Engine, expected, reached, run

    held = pending_steps(models)  # per decode step entering the gate

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            adds = [await e.submit(max_tokens=40) for _ in range(3)]
            for add in adds:  # every lane has streamed a few tokens: rounds run ahead now
                for _ in range(4):
                    assert (await e.receive(add.reply_channel))["type"] == "engine.tokens"
            models.step_gate.close()
            await reached(models.step_gate.held)
            assert held[-1]  # the round held is one planned ahead
            await e.layer.send(ENGINE_CHANNEL, AbortRequest(adds[1].request_id).to_message())
            await e.status()
            models.step_gate.open()
            tokens, last = await e.outcome(adds[1])
            assert last["finish_reason"] == "abort" and tokens == expected(adds[1], 40)[4 : 4 + len(tokens)]
            for add in (adds[0], adds[2]):
                tokens, last = await e.outcome(add)
                assert last["finish_reason"] == "length" and tokens == expected(add, 40)[4:]
            stats = (await e.status())["stats"]
            assert (stats["aborted"], stats["lanes_busy"], stats["kv_pages"]["used"]) == (1, 0, 0)

    run(scenario)


@pytest.fixture
def models(tmp_path):
    from tests.engine.fake_backend import FakeModels

    return FakeModels(tmp_path)


# -- the default model: numpy and cpu backends -------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "List the planets of the solar system:",
    "import numpy as np\n",
    "The recipe for bread calls for",
    "Dear friend, I am writing to tell you",
]
TOKENS = 20


model = test_spec_model.model  # the fixture: the default GGUF on the numpy and cpu backends, its tokenizer


def generate(model, width: int, sampling: dict, *, ahead: bool, stop_at: dict | None = None):
    backend, plan, tok = model
    cfg = EngineConfig(decode_lanes=8, prefill_chunk=256, max_context=512, block_size=16, spec_enabled=False)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), clock=FakeClock(), seed_rng=random.Random(0),
                      max_round_rows=backend.max_round_rows)  # fmt: skip
    for i, text in enumerate(PROMPTS[:width]):
        add = AddRequest(f"p{i}", "c", tok.encode(text, add_special_tokens=True), TOKENS, sampling=dict(sampling))
        add.stop_token_ids = [stop_at[add.request_id]] if stop_at and add.request_id in stop_at else []
        assert sched.add_request(add) is None
    outputs, num_ahead, books = drive(sched, backend, ahead=ahead, clock=sched.clock)
    assert_pool_drained(sched)
    return {rid: tokens_of(o) for rid, o in outputs.items()}, num_ahead, books


@pytest.mark.parametrize("width", [1, 3, 8])
def test_greedy_tokens_are_the_same_ahead_or_not(model, width):
    greedy = {"temperature": 0}  # no stop ids but the one stop_at names
    sync, _, _ = generate(model, width, greedy, ahead=False)
    stop_at = {"p0": sync["p0"][TOKENS // 2]}  # p0 ends on a stop token in the middle of the run
    sync, _, books_sync = generate(model, width, greedy, ahead=False, stop_at=stop_at)
    ahead, num_ahead, books_ahead = generate(model, width, greedy, ahead=True, stop_at=stop_at)
    assert num_ahead >= TOKENS // 4  # most decode rounds ran ahead (p0 stops halfway)
    assert ahead == sync and len(sync["p0"]) <= TOKENS // 2
    assert books_ahead == books_sync


def test_seeded_sampling_is_the_same_ahead_or_not(model):
    if model[0].name == "numpy":
        pytest.skip("sampled rows are the cpu backend's run (the numpy one adds CI time for the same rule)")
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "min_tokens": 3}
    sync, _, _ = generate(model, 3, sampled, ahead=False)
    ahead, num_ahead, _ = generate(model, 3, sampled, ahead=True)
    assert num_ahead > 0 and ahead == sync


def test_the_pending_token_is_the_one_the_round_drew(model):
    """The backend's own books: a round fed PENDING reads the token its lane drew the step before."""
    backend = model[0]
    ahead, num_ahead, _ = generate(model, 1, {"temperature": 0}, ahead=True)
    assert num_ahead > 0 and list(backend.last_tokens.values()) == [ahead["p0"][-1]]
