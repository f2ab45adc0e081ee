"""The worker and its model host on the fake backend and the in-memory Channels layer.

No Django server, no ORM: an EngineWorker runs as a task, a test talks to it
over InMemoryChannelLayer as the Django side would, and reads the state the
``engine.status`` reply reports at each point. Loads and steps run on the
worker's step thread, so the fake's gates are threading Events; a test waits
on them, on replies, or on the engine's own log events, never on the clock
(every wait is bounded by TIMEOUT so a hang fails instead of stalling).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter

import pytest
from channels.layers import InMemoryChannelLayer

from engine.config import EngineConfig
from engine.memory import EMPTY_PLAN
from engine.messages import ENGINE_CHANNEL, AbortRequest, AddRequest, ConfigureEngine, SwitchModel, UnloadModel
from engine.status import EngineState, EngineStatus
from engine.worker import EngineWorker
from tests.engine.fake_backend import VOCAB, FakeBackend, FakeModels

TIMEOUT = 10.0

# The keys of the engine.status reply, as the worker's status_message() sent them before
# EngineStatus existed: the Django side reads them, so they are pinned here.
STATUS_KEYS = {"type", "status", "model", "error", "backend", "max_context", "path", "switching", "last_switch"}
STATUS_KEYS |= {"recent_switches", "switch_outcomes", "load_progress", "idle_unload", "idle_seconds"}
STATUS_KEYS |= {"stats", "lanes", "plan", "telemetry", "backend_stats"}
STATS_KEYS = {"requests_by_state", "requests_by_class", "lanes_total", "lanes_busy", "lanes_decoding", "kv_pages"}
STATS_KEYS |= {"prefix_hits", "cached_tokens", "round_seconds", "admitted", "refused", "finished", "aborted"}
STATS_KEYS |= {"preempted", "recomputed", "decoded_tokens", "prefilled_tokens", "decode_rounds", "prefill_chunks"}
STATS_KEYS |= {"spec_drafted", "spec_accepted", "spec_trimmed", "loop_guard_fired", "loop_guard_taken_back"}


def expected(add: AddRequest, n: int) -> list[int]:
    ctx = list(add.prompt_token_ids)
    for _ in range(n):
        ctx.append(FakeBackend.next_token(ctx))
    return ctx[len(add.prompt_token_ids) :]


async def reached(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, TIMEOUT), "the fake never got there"


class LogEvents(logging.Handler):
    """Counts the engine's log events; ``wait`` returns once one has been logged n times."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()
        self.cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.counts[record.getMessage()] += 1
            self.cond.notify_all()

    def _wait(self, name: str, n: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.counts[name] >= n, TIMEOUT)

    async def wait(self, name: str, n: int = 1) -> None:
        assert await asyncio.to_thread(self._wait, name, n), f"{name} not logged {n} times"


@pytest.fixture
def logs():
    logger, handler = logging.getLogger("ignis.engine"), LogEvents()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def models(tmp_path) -> FakeModels:
    return FakeModels(tmp_path)


class Engine:
    """A worker on the fake models, and the client side of the layer."""

    def __init__(self, models: FakeModels, path, served_id: str = "m1", **options) -> None:
        self.models, self.layer, self.n = models, InMemoryChannelLayer(), 0
        cfg = EngineConfig(backend="fake", decode_lanes=4, prefill_chunk=16, max_context=512, block_size=4)
        self.worker = EngineWorker(
            self.layer, cfg, path, served_id, loader=models.load, backend_factory=models.create_backend, **options
        )

    async def __aenter__(self) -> Engine:
        self.task = asyncio.create_task(self.worker.run())
        return self

    async def __aexit__(self, *exc) -> None:
        self.models.load_gate.open()
        self.models.step_gate.open()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def receive(self, channel: str) -> dict:
        return await asyncio.wait_for(self.layer.receive(channel), TIMEOUT)

    async def status(self) -> dict:
        """The engine.status reply. The engine channel is FIFO, so everything sent before
        has reached the worker (its inbox, or the host) when this returns."""
        reply = await self.layer.new_channel()
        await self.layer.send(ENGINE_CHANNEL, {"type": "engine.status", "reply_channel": reply})
        return await self.receive(reply)

    async def submit(self, prompt: list[int] | None = None, max_tokens: int = 4, **kw) -> AddRequest:
        self.n += 1
        prompt = prompt or [(self.n * 31 + j * 7) % VOCAB for j in range(6)]
        add = AddRequest(f"r{self.n}", await self.layer.new_channel(), prompt, max_tokens, **kw)
        await self.layer.send(ENGINE_CHANNEL, add.to_message())
        return add

    async def outcome(self, add: AddRequest) -> tuple[list[int], dict]:
        """The tokens streamed to ``add``, and its last message (engine.finished or engine.failed)."""
        tokens = []
        while (msg := await self.receive(add.reply_channel))["type"] == "engine.tokens":
            tokens += msg["token_ids"]
        return tokens, msg

    async def serve(self, max_tokens: int = 4, **kw) -> dict:
        """One request served in full, token for token."""
        add = await self.submit(max_tokens=max_tokens, **kw)
        tokens, last = await self.outcome(add)
        assert last["type"] == "engine.finished", last
        assert tokens == expected(add, max_tokens) and last["finish_reason"] == "length"
        return last

    async def switch(self, path, served_id: str) -> tuple[dict, str]:
        """Ask for a switch; returns its SwitchAck and the channel its SwitchDone comes on."""
        self.n += 1
        reply = await self.layer.new_channel()
        sw = SwitchModel(f"sw-{self.n}", served_id, str(path), reply_channel=reply)
        await self.layer.send(ENGINE_CHANNEL, sw.to_message())
        return await self.receive(reply), reply

    async def unload(self) -> None:
        await self.layer.send(ENGINE_CHANNEL, UnloadModel().to_message())


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 6 * TIMEOUT))


def refused_with(msg: dict, code: str, status: int) -> bool:
    return msg["type"] == "engine.failed" and (msg["code"], msg["status"]) == (code, status)


# -- loading and serving -------------------------------------------------------


def test_load_then_serve_reports_each_state(models):
    m1 = models.model("m1", max_position=256)
    models.load_gate.close()

    async def scenario():
        async with Engine(models, m1) as e:
            await reached(models.load_gate.held)
            st = await e.status()
            assert st["status"] == "loading" and st["load_progress"] == {"done": 0, "total": 1, "unit": "tensors"}
            assert set(st) == STATUS_KEYS - {"stats", "lanes"} and st["plan"] == EMPTY_PLAN
            models.load_gate.open()
            await e.serve(max_tokens=5)
            st = await e.status()
            assert (st["status"], st["model"], st["error"], st["backend"]) == ("serving", "m1", None, "fake")
            assert st["max_context"] == 256 and st["load_progress"] is None  # clamped to the model's own
            assert set(st) == STATUS_KEYS and set(st["stats"]) == STATS_KEYS
            assert (st["stats"]["finished"], st["stats"]["lanes_busy"], st["plan"]["num_blocks"]) == (1, 0, 64)
            assert EngineStatus.from_message(st).status is EngineState.SERVING

    run(scenario)


def test_abort_ends_a_stream_at_once(models):
    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            models.step_gate.close()
            add = await e.submit(max_tokens=50)
            await reached(models.step_gate.held)  # its prefill runs
            await e.layer.send(ENGINE_CHANNEL, AbortRequest(add.request_id).to_message())
            await e.status()  # the abort is in the inbox
            models.step_gate.open()
            tokens, last = await e.outcome(add)
            assert tokens == expected(add, 1)  # the step that ran, then the abort
            assert last["type"] == "engine.finished" and last["finish_reason"] == "abort"
            stats = (await e.status())["stats"]
            assert (stats["aborted"], stats["lanes_busy"], stats["kv_pages"]["used"]) == (1, 0, 0)

    run(scenario)


def test_a_step_that_raises_ends_only_the_row_that_raised(models, logs):
    """The failing step carries a decoding lane and a poisoned prompt's prefill: the worker
    runs each row alone, so only the poisoned request ends with engine_error; the lane
    goes on token for token (its KV rewritten in place), and a waiting request is served."""
    poison = 990

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            lane = await e.submit(max_tokens=60)
            assert (await e.receive(lane.reply_channel))["token_ids"] == expected(lane, 1)  # it decodes now
            models.step_gate.close()
            await reached(models.step_gate.held)  # a decode round is in flight
            bad = await e.submit(prompt=[poison, 1, 2, 3])
            waiting = await e.submit()
            await e.status()  # both are in the inbox
            models.fail_step = lambda plan: plan.prefill is not None and poison in plan.prefill.token_ids
            models.step_gate.open()
            _, last = await e.outcome(bad)
            assert refused_with(last, "engine_error", 500)
            assert last["message"] == "The engine failed while running this request."
            for add, want in ((lane, expected(lane, 60)[1:]), (waiting, expected(waiting, 4))):
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and last["finish_reason"] == "length"
                assert tokens == want
            await logs.wait("ignis.engine.row_failed")
            st = await e.status()
            assert st["status"] == "serving" and st["stats"]["aborted"] == 1 and st["stats"]["lanes_busy"] == 0
            await e.serve()

    run(scenario)


def test_a_decode_lane_that_raises_ends_alone(models):
    """Three lanes decode; every round that carries the poisoned one raises. That one ends with
    engine_error at its first failing round; the other two stream every token they would alone."""

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            models.step_gate.close()
            adds = [await e.submit(max_tokens=12, sampling={"top_k": k}) for k in (0, 7, 0)]
            bad = adds[1]
            models.fail_step = lambda plan: any(
                lane.sample.params.top_k == 7 and lane.position > len(bad.prompt_token_ids) for lane in plan.decode
            )
            models.step_gate.open()
            await e.status()
            tokens, last = await e.outcome(bad)
            assert refused_with(last, "engine_error", 500) and len(tokens) >= 1
            for add in (adds[0], adds[2]):
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and tokens == expected(add, 12)
            stats = (await e.status())["stats"]
            assert (stats["aborted"], stats["lanes_busy"], stats["kv_pages"]["used"]) == (1, 0, 0)

    run(scenario)


# -- switches ------------------------------------------------------------------


def test_a_prefill_beside_a_round_answers_before_the_round_ends(models):
    """A prompt admitted while a lane decodes prefills in the step that also runs the lane's round:
    its first token reaches the client while that round is still held on the step thread, and both
    streams are the tokens they would be alone."""
    released, held = threading.Event(), threading.Event()
    create = models.create_backend

    def create_backend(*args, **kw):
        backend = create(*args, **kw)

        def hold_the_round_after_a_prefill(plan):  # of another sequence than its lanes (before_step:
            before = backend.plans[-1].prefill if backend.plans else None  # the plan before is last)
            if plan.decode and before is not None and before.seq_id not in {ln.seq_id for ln in plan.decode}:
                held.set()
                released.wait(TIMEOUT)

        backend.before_step = hold_the_round_after_a_prefill
        return backend

    models.create_backend = create_backend

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            lane = await e.submit(max_tokens=40)
            assert (await e.receive(lane.reply_channel))["token_ids"] == expected(lane, 1)  # it decodes now
            late = await e.submit(max_tokens=5)
            first = await e.receive(late.reply_channel)
            assert first["token_ids"] == expected(late, 1) and first["ttft"] is not None
            assert held.is_set() and not released.is_set()  # the round beside its prefill has not ended
            released.set()
            for add, want in ((lane, expected(lane, 40)[1:]), (late, expected(late, 5)[1:])):
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and tokens == want

    try:
        run(scenario)
    finally:
        released.set()


def test_drain_then_switch(models):
    m1, m2 = models.model("m1"), models.model("m2", max_position=128)

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            models.step_gate.close()
            running = await e.submit(max_tokens=6)
            await reached(models.step_gate.held)  # admitted: its prefill is in a step
            ack, reply = await e.switch(m2, "m2")
            assert ack["type"] == "engine.switch_ack" and ack["accepted"]
            second, _ = await e.switch(m1, "m1")
            assert not second["accepted"] and second["message"] == "A switch is running."
            late = await e.submit()
            st = await e.status()  # (late is in the inbox)
            assert st["status"] == "switching" and st["switching"] == {"from": "m1", "to": "m2"}
            assert st["stats"]["lanes_busy"] == 1 and models.loads == [m1]
            models.step_gate.open()
            tokens, last = await e.outcome(running)  # drained: it runs to its end
            assert last["type"] == "engine.finished" and tokens == expected(running, 6)
            _, refused = await e.outcome(late)
            assert refused_with(refused, "model_switching", 503) and refused["retry_after"] == 5
            done = await e.receive(reply)
            assert done["type"] == "engine.switch_done"
            assert (done["outcome"], done["reason"], done["served_id"]) == ("switched", "", "m2")
            assert models.backends[0].unloaded.is_set() and models.loads == [m1, m2]
            st = await e.status()
            assert (st["status"], st["model"], st["path"], st["max_context"]) == ("serving", "m2", str(m2), 128)
            assert st["switching"] is None and st["switch_outcomes"] == {"switched": 1}
            assert st["last_switch"]["outcome"] == "switched" and st["last_switch"]["from"] == "m1"
            assert [s["switch_id"] for s in st["recent_switches"]] == [ack["switch_id"]]
            await e.serve(model="m2")

    run(scenario)


def test_a_drain_that_times_out_ends_what_still_runs(models):
    m1, m2 = models.model("m1"), models.model("m2")

    async def scenario():
        async with Engine(models, m1, drain_timeout=0) as e:
            models.step_gate.close()
            running = await e.submit(max_tokens=50)
            await reached(models.step_gate.held)
            ack, reply = await e.switch(m2, "m2")
            assert ack["accepted"]
            await asyncio.wait_for(e.worker.host._precheck, TIMEOUT)  # only the drain is left to wait for
            models.step_gate.open()
            tokens, last = await e.outcome(running)
            assert tokens == expected(running, 1) and refused_with(last, "engine_error", 500)
            assert last["message"] == "The server switched models while this request ran."
            assert (await e.receive(reply))["outcome"] == "switched"
            await e.serve(model="m2")

    run(scenario)


def test_a_refused_switch_tears_nothing_down(models, tmp_path):
    m1 = models.model("m1")

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            ack, reply = await e.switch(tmp_path / "missing", "ghost")
            assert ack["accepted"]
            done = await e.receive(reply)
            assert (done["outcome"], done["served_id"]) == ("refused", "m1")
            assert done["reason"] == f"no file at {tmp_path / 'missing'}"
            assert len(models.backends) == 1 and not models.backends[0].unloaded.is_set()
            assert models.loads == [m1]
            st = await e.status()
            assert (st["status"], st["model"], st["switching"]) == ("serving", "m1", None)
            assert st["switch_outcomes"] == {"refused": 1} and st["last_switch"]["to"] == "ghost"
            await e.serve()

    run(scenario)


def test_restored_after_the_new_model_fails_to_load(models):
    m1, m2 = models.model("m1"), models.model("m2")
    models.failing.add(m2)

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            _, reply = await e.switch(m2, "m2")
            done = await e.receive(reply)
            assert (done["outcome"], done["reason"], done["served_id"]) == (
                "restored",
                "RuntimeError: cannot load m2",
                "m1",
            )
            assert models.loads == [m1, m2, m1] and models.backends[0].unloaded.is_set()
            st = await e.status()
            assert (st["status"], st["model"], st["path"], st["error"]) == ("serving", "m1", str(m1), None)
            assert st["last_switch"]["outcome"] == "restored" and st["switch_outcomes"] == {"restored": 1}
            await e.serve()

    run(scenario)


def test_failed_when_the_restore_fails_too_and_a_request_retries_the_load(models):
    m1, m2 = models.model("m1"), models.model("m2")

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            models.failing |= {m1, m2}
            _, reply = await e.switch(m2, "m2")
            done = await e.receive(reply)
            assert done["outcome"] == "failed"
            assert (
                done["reason"] == "RuntimeError: cannot load m2; restoring m1 failed too: RuntimeError: cannot load m1"
            )
            st = await e.status()
            assert (st["status"], st["model"], st["error"]) == ("failed", "m1", "RuntimeError: cannot load m1")
            assert "stats" not in st and st["plan"] == EMPTY_PLAN
            _, refused = await e.outcome(await e.submit())  # it reloads for this request; that fails
            assert refused_with(refused, "model_load_failed", 503)
            assert refused["message"] == "The model failed to load: RuntimeError: cannot load m1"
            models.failing.clear()
            await e.serve()  # the next request tries again
            assert (await e.status())["status"] == "serving" and models.loads == [m1, m2, m1, m1, m1]

    run(scenario)


def test_the_first_load_fails_then_a_request_reloads(models):
    m1 = models.model("m1")
    models.failing.add(m1)

    async def scenario():
        async with Engine(models, m1) as e:
            _, refused = await e.outcome(await e.submit())
            assert refused_with(refused, "model_load_failed", 503) and "cannot load m1" in refused["message"]
            st = await e.status()
            assert st["status"] == "failed" and st["error"] == "RuntimeError: cannot load m1"
            models.failing.clear()
            await e.serve()
            assert (await e.status())["status"] == "serving" and models.loads == [m1, m1, m1]

    run(scenario)


def test_a_switch_accepted_while_loading_resumes_from_the_load(models):
    """The load that was running when the switch came in succeeded, so the switch
    starts from a serving model: when the new one fails, the old one is restored."""
    m1, m2 = models.model("m1"), models.model("m2")
    models.failing.add(m2)
    models.load_gate.close()

    async def scenario():
        async with Engine(models, m1) as e:
            await reached(models.load_gate.held)
            ack, reply = await e.switch(m2, "m2")
            assert ack["accepted"] and (await e.status())["status"] == "switching"
            models.load_gate.open()
            assert (await e.receive(reply))["outcome"] == "restored"
            assert models.loads == [m1, m2, m1] and (await e.status())["status"] == "serving"
            await e.serve()

    run(scenario)


# -- idle unload and the reload after it ---------------------------------------


def test_idle_unload_after_idle_unload_seconds(models, logs):
    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            await e.serve()
            reply = await e.layer.new_channel()
            configure = ConfigureEngine({"idle_unload": 0.05}).to_message()
            await e.layer.send(ENGINE_CHANNEL, {**configure, "reply_channel": reply})
            assert (await e.receive(reply))["type"] == "engine.configured"
            await logs.wait("ignis.model.unloaded")  # logged once the state is unloaded
            st = await e.status()
            assert (st["status"], st["idle_unload"]) == ("unloaded", 0.05) and st["idle_seconds"] >= 0.05
            assert "stats" not in st and st["plan"] == EMPTY_PLAN and models.backends[0].unloaded.is_set()
            await e.serve()
            assert (await e.status())["status"] == "serving"

    run(scenario)


def test_a_reload_serves_the_requests_that_waited_for_it(models, logs):
    m1 = models.model("m1")

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            await e.unload()
            await logs.wait("ignis.model.unloaded")
            assert (await e.status())["status"] == "unloaded"
            models.load_gate.close()
            first = await e.submit()
            await reached(models.load_gate.held)  # the first request started the reload
            second = await e.submit()
            assert (await e.status())["status"] == "loading"  # (second waits in the inbox)
            models.load_gate.open()
            for add in (first, second):
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and tokens == expected(add, 4)
            assert (await e.status())["status"] == "serving" and models.loads == [m1, m1]

    run(scenario)


def test_a_failed_reload_refuses_every_request_that_waited(models, logs):
    m1 = models.model("m1")

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            await e.unload()
            await logs.wait("ignis.model.unloaded")
            models.failing.add(m1)
            models.load_gate.close()
            first = await e.submit()
            await reached(models.load_gate.held)
            second = await e.submit()
            await e.status()
            models.load_gate.open()
            for add in (first, second):
                _, refused = await e.outcome(add)
                assert refused_with(refused, "model_load_failed", 503)
                assert refused["message"] == "The model failed to load: RuntimeError: cannot load m1"
            assert (await e.status())["status"] == "failed"

    run(scenario)


def test_a_switch_refused_while_unloaded_leaves_it_unloaded(models, logs, tmp_path):
    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            await e.serve()
            await e.unload()
            await logs.wait("ignis.model.unloaded")
            _, reply = await e.switch(tmp_path / "missing", "ghost")
            assert (await e.receive(reply))["outcome"] == "refused"
            assert (await e.status())["status"] == "unloaded"  # the state it left, not serving
            await e.serve()

    run(scenario)


def test_a_switch_to_what_serves_is_a_no_op(models):
    """Same id, artifact and configuration: answered at once, no reload, the statistics and
    the retained prefixes stay, and it is no switch in the history. A new config still reloads."""
    m1 = models.model("m1")

    async def scenario():
        async with Engine(models, m1) as e:
            await e.serve()
            ack, _ = await e.switch(m1, "m1")
            assert ack["accepted"] and ack["unchanged"]
            st = await e.status()
            assert (st["status"], st["last_switch"], st["recent_switches"], st["switch_outcomes"]) == (
                "serving",
                None,
                [],
                {},
            )
            assert st["stats"]["finished"] == 1 and models.loads == [m1]
            reply = await e.layer.new_channel()
            sw = SwitchModel("sw-config", "m1", str(m1), config={"prefill_chunk": 8}, reply_channel=reply)
            await e.layer.send(ENGINE_CHANNEL, sw.to_message())
            ack = await e.receive(reply)
            assert ack["accepted"] and not ack["unchanged"]
            done = await e.receive(reply)
            assert done["outcome"] == "switched" and models.loads == [m1, m1]

    run(scenario)


def test_a_grammar_compiles_off_the_event_loop(models, monkeypatch):
    import engine.worker as worker_mod

    threads = []

    def compile_grammar(grammar, stop_token_ids, constraints):
        threads.append(threading.current_thread())
        return "The output grammar does not compile: fake"

    monkeypatch.setattr(worker_mod, "compile_grammar", compile_grammar)

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            add = await e.submit(grammar="start: 'x'")
            _, last = await e.outcome(add)
            assert refused_with(last, "invalid_grammar", 400)
            assert threads and threads[0] is not threading.main_thread()
            await e.serve()

    run(scenario)


def test_swaps_that_raise_end_the_plan_and_the_lanes_they_moved(tmp_path):
    """Two lanes outgrow a 6-block pool: the step that preempts one raises in its swap (again when
    run alone). Both end with engine_error, no page stays taken, and the engine serves on."""
    models = FakeModels(tmp_path, num_blocks=6, block_size=4, num_host_blocks=16)

    async def scenario():
        async with Engine(models, models.model("m1")) as e:
            models.fail_step = lambda plan: bool(plan.swap_out)
            a, b = await e.submit(max_tokens=14), await e.submit(max_tokens=14)
            for add in (a, b):
                _, last = await e.outcome(add)
                assert refused_with(last, "engine_error", 500), last
            models.fail_step = None
            stats = (await e.status())["stats"]
            assert (stats["aborted"], stats["lanes_busy"], stats["kv_pages"]["used"]) == (2, 0, 0)
            assert stats["preempted"] == 1
            await e.serve()

    run(scenario)
