"""serve's EngineThread: the real EngineWorker (fake backend) on a thread and loop of its own,
talking to this test's loop (Daphne's stand-in) over the CrossLoopChannelLayer.

The point of the thread: the engine runs whole requests while the server's loop is busy.
One test blocks this loop outright and waits, bounded, for the engine to finish a request
meanwhile; with the engine on this loop that cannot happen.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from apps.models.management.commands.serve import EngineThread
from engine.config import EngineConfig
from engine.messages import ENGINE_CHANNEL, AddRequest
from engine.worker import EngineWorker
from ignis_site.channel_layer import CrossLoopChannelLayer
from tests.engine.fake_backend import VOCAB, FakeBackend, FakeModels

TIMEOUT = 10.0


def expected(add: AddRequest, n: int) -> list[int]:
    ctx = list(add.prompt_token_ids)
    for _ in range(n):
        ctx.append(FakeBackend.next_token(ctx))
    return ctx[len(add.prompt_token_ids) :]


class Done(logging.Handler):
    """Sets ``event`` when the engine logs ignis.request.done (from the engine's thread)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "ignis.request.done":
            self.event.set()


@pytest.fixture
def done():
    logger, handler = logging.getLogger("ignis.engine"), Done()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


class Hosted:
    """An EngineThread over the fake models; ``seen`` records where make_worker ran."""

    def __init__(self, tmp_path) -> None:
        self.models = FakeModels(tmp_path)
        self.layer = CrossLoopChannelLayer(capacity=1000)
        self.seen: dict = {}
        path = self.models.model("m1")
        cfg = EngineConfig(backend="fake", decode_lanes=4, prefill_chunk=16, max_context=512, block_size=4)

        def make_worker() -> EngineWorker:
            self.seen.update(thread=threading.current_thread().name, loop=asyncio.get_running_loop())
            self.worker = EngineWorker(
                self.layer, cfg, path, "m1", loader=self.models.load, backend_factory=self.models.create_backend
            )
            return self.worker

        self.make_worker = make_worker

    async def submit(self, i: int, max_tokens: int) -> AddRequest:
        prompt = [(i * 31 + j * 7) % VOCAB for j in range(6)]
        add = AddRequest(f"r{i}", await self.layer.new_channel(), prompt, max_tokens)
        await self.layer.send(ENGINE_CHANNEL, add.to_message())
        return add

    async def outcome(self, add: AddRequest) -> tuple[list[int], dict]:
        tokens = []
        while (msg := await asyncio.wait_for(self.layer.receive(add.reply_channel), TIMEOUT))[
            "type"
        ] == "engine.tokens":
            tokens += msg["token_ids"]
        return tokens, msg


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 6 * TIMEOUT))


def test_the_engine_serves_from_its_own_thread_and_loop(tmp_path):
    hosted = Hosted(tmp_path)

    async def scenario():
        here = asyncio.get_running_loop()
        engine = EngineThread(hosted.make_worker, server_loop=here)
        engine.start()
        try:
            adds = [await hosted.submit(i, 6) for i in range(3)]
            for add in adds:
                tokens, last = await hosted.outcome(add)
                assert tokens == expected(add, 6) and last["type"] == "engine.finished"
        finally:
            engine.stop(TIMEOUT)
        assert hosted.seen["thread"] == "ignis-engine" and hosted.seen["loop"] is not here
        assert engine.loop is hosted.seen["loop"] and engine.loop.is_closed()
        assert not engine.thread.is_alive() and engine.task.cancelled()

    run(scenario)


def test_the_engine_finishes_a_request_while_the_server_loop_is_blocked(tmp_path, done):
    hosted = Hosted(tmp_path)

    async def scenario():
        engine = EngineThread(hosted.make_worker, server_loop=asyncio.get_running_loop())
        engine.start()
        try:
            add = await hosted.submit(1, 8)
            # This loop is now blocked (no await) until the engine has finished the request.
            assert done.event.wait(TIMEOUT), "the engine made no progress while the server loop was busy"
            tokens, last = await hosted.outcome(add)  # all of it was waiting on the channel
            assert tokens == expected(add, 8) and last["finish_reason"] == "length"
        finally:
            engine.stop(TIMEOUT)

    run(scenario)


def test_stop_before_the_model_loaded_ends_the_thread(tmp_path):
    hosted = Hosted(tmp_path)
    hosted.models.load_gate.close()  # the load waits on the step thread

    async def scenario():
        engine = EngineThread(hosted.make_worker, server_loop=asyncio.get_running_loop())
        engine.start()
        assert await asyncio.to_thread(hosted.models.load_gate.held.wait, TIMEOUT)
        stopping = asyncio.ensure_future(asyncio.to_thread(engine.stop, TIMEOUT))
        hosted.models.load_gate.open()  # the step thread's load returns; the cancelled loop ends
        await stopping
        assert not engine.thread.is_alive()

    run(scenario)
