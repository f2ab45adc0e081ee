"""A fleet worker's drain (SIGTERM, docs/FLEET.md): it says ``leaving`` only once every request it
took has had its last message handed to the layer; and its beats say a request streams before
its client can see a token.

The worker runs on the fake backend (tests/engine/test_worker.py's harness) over a layer that
records each message once its send has completed and can hold one send open, so the window the
drain once lost a stream in (the step finished a request, its engine.finished not yet sent) is
held open by the test instead of hit by chance.
"""

from __future__ import annotations

import asyncio

from channels.layers import InMemoryChannelLayer

from engine.messages import ENGINE_CHANNEL, STATUS_GROUP, AddRequest
from tests.engine import test_worker
from tests.engine.test_worker import TIMEOUT, Engine, expected, reached, refused_with, run

models, logs = test_worker.models, test_worker.logs  # the fixtures


class HeldLayer(InMemoryChannelLayer):
    """Records every message whose send (or group send) has completed, in that order; a send of the
    message ``hold`` names (type, request_id) waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.done: list[dict] = []
        self.hold: tuple[str, str] | None = None
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def send(self, channel: str, message: dict) -> None:
        if self.hold == (message.get("type"), message.get("request_id")):
            self.holding.set()
            await self.release.wait()
        await super().send(channel, message)
        self.done.append(message)

    async def group_send(self, group: str, message: dict) -> None:
        await super().group_send(group, message)  # nobody joined STATUS_GROUP: no send() per member
        if group == STATUS_GROUP:
            self.done.append(message)

    def beats(self) -> list[dict]:
        return [m for m in self.done if m["type"] == "engine.heartbeat"]

    def index(self, predicate) -> int:
        return next(i for i, m in enumerate(self.done) if predicate(m))


def held_engine(models, path, **options) -> tuple[Engine, HeldLayer]:
    engine, layer = Engine(models, path, **options), HeldLayer()
    engine.layer = engine.worker.layer = layer
    return engine, layer


async def turns_until_done(task: asyncio.Task, turns: int = 200) -> None:
    """Let every other task run this many times over (no clock): a drain with nothing to wait for
    gets to its end in a few turns (its beats go out on this in-memory layer without waiting)."""
    for _ in range(turns):
        if task.done():
            return
        await asyncio.sleep(0)


def test_a_drain_waits_for_the_last_message_of_a_request_its_step_finished(models):
    """The stream lost at stop 22: the step that finished the last request took it out of the
    scheduler; the drain must not say ``leaving`` (and let the process exit) while that
    request's engine.finished is still on its way."""
    m1 = models.model("m1")

    async def scenario():
        e, layer = held_engine(models, m1)
        async with e:
            layer.hold = ("engine.finished", f"r{e.n + 1}")
            add = await e.submit(max_tokens=3)
            await asyncio.wait_for(layer.holding.wait(), TIMEOUT)  # finished; its last message held in send
            assert e.worker.host.scheduler.seqs == {}  # the scheduler's books: nothing runs any more
            drain = asyncio.create_task(e.worker.drain(TIMEOUT))
            await turns_until_done(drain)
            assert not drain.done(), "the drain ended while a request's last message was unsent"
            draining = [b for b in layer.beats() if b["draining"]]
            assert draining and draining[0]["running_request_ids"] == [add.request_id]  # still owed: listed
            assert not [b for b in layer.beats() if b["leaving"]]
            layer.release.set()
            assert await asyncio.wait_for(drain, TIMEOUT) == 0
            finished = layer.index(lambda m: m["type"] == "engine.finished")
            leaving = layer.index(lambda m: m.get("leaving"))
            assert finished < leaving
            assert layer.beats()[-1]["leaving"] and layer.beats()[-1]["running_request_ids"] == []
            tokens, last = await e.outcome(add)
            assert last["type"] == "engine.finished" and tokens == expected(add, 3)

    run(scenario)


def test_a_drain_counts_what_is_queued_and_answers_it_before_leaving(models, logs):
    """A request still in the inbox when the signal lands (the loop was in a step) is owed too: it
    is refused (engine_unavailable, Retry-After 1) before the leaving beat; the running one finishes."""
    m1 = models.model("m1")

    async def scenario():
        e, layer = held_engine(models, m1)
        async with e:
            models.step_gate.close()
            running = await e.submit(max_tokens=5)
            await reached(models.step_gate.held)  # the loop is in a step: what comes now waits in the inbox
            queued = await e.submit(max_tokens=5)
            await e.status()  # FIFO: queued has reached the worker's inbox
            drain = asyncio.create_task(e.worker.drain(TIMEOUT))
            await logs.wait("ignis.engine.draining")
            draining = [b for b in layer.beats() if b["draining"]][0]
            assert draining["waiting_request_ids"] == [running.request_id, queued.request_id]
            models.step_gate.open()
            assert await asyncio.wait_for(drain, TIMEOUT) == 0
            tokens, last = await e.outcome(running)
            assert last["type"] == "engine.finished" and tokens == expected(running, 5)
            _, refused = await e.outcome(queued)
            assert refused_with(refused, "engine_unavailable", 503) and refused["retry_after"] == 1
            leaving = layer.index(lambda m: m.get("leaving"))
            assert leaving > layer.index(lambda m: m.get("request_id") == queued.request_id)
            assert leaving > layer.index(lambda m: m["type"] == "engine.finished")

    run(scenario)


def test_a_drain_past_its_timeout_ends_what_runs_and_what_is_queued(models):
    m1 = models.model("m1")

    async def scenario():
        e, layer = held_engine(models, m1)
        async with e:
            models.step_gate.close()
            running = await e.submit(max_tokens=50)
            await reached(models.step_gate.held)
            queued = await e.submit(max_tokens=5)
            await e.status()
            assert await asyncio.wait_for(e.worker.drain(0), TIMEOUT) == 2
            assert layer.beats()[-1]["leaving"] and e.worker.busy_request_ids() == []
            for add in (running, queued):
                _, last = await e.outcome(add)
                assert refused_with(last, "engine_error", 500), last
            models.step_gate.open()

    run(scenario)


def test_a_worker_in_its_own_process_beats_that_a_request_streams_before_its_first_token_goes_out(models):
    """Should it die, a front end sends a request its last beat listed as waiting to another worker
    (or, with none, ends it engine_unavailable: retry me): a stream must be listed as running before
    its client can see a token (or it would see its first tokens twice). runengine's worker, a
    fleet's or a lone one, does so; an embedded one dies with its front end."""
    m1 = models.model("m1")

    async def scenario():
        e, layer = held_engine(models, m1)
        assert not e.worker.beats_before_first_tokens  # embedded, by default
        e.worker.beats_before_first_tokens = True  # as runengine's (its channel stays the harness's)
        async with e:
            adds = [await e.submit(max_tokens=3) for _ in range(3)]
            for add in adds:
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and tokens == expected(add, 3)
        for add in adds:
            first = layer.index(lambda m, rid=add.request_id: m["type"] == "engine.tokens" and m["request_id"] == rid)
            listed = layer.index(
                lambda m, rid=add.request_id: m["type"] == "engine.heartbeat" and rid in m["running_request_ids"]
            )
            assert listed < first, add.request_id

    run(scenario)


def test_a_request_sent_again_while_it_runs_is_served_once_and_the_engine_goes_on(models):
    """A front end that took the engine for gone (its heartbeats late) sends what it thought queued
    again, to the same reply channel: the engine serves the request once, and keeps serving. Once,
    such a resend cost the first request its reply channel and the next token stopped the engine."""
    m1 = models.model("m1")

    async def scenario():
        async with Engine(models, m1) as e:
            add = await e.submit(max_tokens=6)
            await e.layer.send(ENGINE_CHANNEL, add.to_message())  # the same request, the same channel
            tokens, last = await e.outcome(add)
            assert last["type"] == "engine.finished" and tokens == expected(add, 6)
            again = await e.submit(max_tokens=40)
            elsewhere = await e.layer.new_channel()  # the same id from another client: refused there alone
            await e.layer.send(ENGINE_CHANNEL, AddRequest(again.request_id, elsewhere, [1, 2], 4).to_message())
            assert refused_with(await e.receive(elsewhere), "duplicate_request", 400)
            tokens, last = await e.outcome(again)
            assert last["type"] == "engine.finished" and tokens == expected(again, 40)
            await e.serve()  # still serving

    run(scenario)
