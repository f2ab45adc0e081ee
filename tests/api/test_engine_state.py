"""The front end's cached engine status (apps/core/engine_state.py), fed by a real worker
on the fake backend over the in-memory layer: requests read it without a round trip, and
an engine that stops sending heartbeats ends the requests it held and refuses new ones
until an engine answers again (issue 11 points 4 and 5)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from channels.layers import InMemoryChannelLayer
from django.conf import settings

from apps.core import engine_client, engine_state
from apps.core.errors import IgnisError
from apps.models import switching
from engine.config import EngineConfig
from engine.messages import AddRequest
from engine.worker import EngineWorker
from tests.engine.fake_backend import FakeModels

TIMEOUT = 10.0


async def until(probe, message: str) -> None:
    """Yield to the loop until ``probe()`` holds (bounded: a hang fails)."""
    deadline = time.monotonic() + TIMEOUT
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {message}"
        await asyncio.sleep(0.01)


@pytest.fixture
def front_end(monkeypatch):
    """A fresh cache and layer for this test; the listener's side work (tokenizer, history) is recorded."""
    layer = InMemoryChannelLayer()
    cache = engine_state.EngineStateCache()
    took = []

    async def note(beat, came_back):
        took.append((beat.engine_id, came_back))

    monkeypatch.setattr(engine_state, "CACHE", cache)
    monkeypatch.setattr(engine_state, "get_channel_layer", lambda: layer)
    monkeypatch.setattr(engine_client, "get_channel_layer", lambda: layer)
    monkeypatch.setattr(engine_state, "_took", note)
    monkeypatch.setattr(switching, "served_model_update", lambda **kw: None)  # the fake model is no real one
    monkeypatch.setitem(settings.IGNIS, "server.engine_timeout", 1.5)

    async def no_round_trip(timeout: float = 2.0):
        raise AssertionError("requests read the pushed status")

    monkeypatch.setattr(engine_client, "engine_status_ask", no_round_trip)
    return layer, cache, took


def worker(layer, models: FakeModels, path) -> EngineWorker:
    cfg = EngineConfig(backend="fake", decode_lanes=4, prefill_chunk=16, max_context=512, block_size=4)
    return EngineWorker(
        layer, cfg, path, "m1", heartbeat=0.05, loader=models.load, backend_factory=models.create_backend
    )


async def gate() -> IgnisError | None:
    try:
        await switching.switch_gate(method="POST", path="/v1/chat/completions")
    except IgnisError as err:
        return err
    return None


def test_a_silent_engine_ends_what_it_held_refuses_new_requests_and_service_comes_back(front_end, tmp_path):
    layer, cache, took = front_end
    models = FakeModels(tmp_path)
    m1 = models.model("m1")

    async def scenario():
        listener = asyncio.create_task(engine_state.engine_state_listen())
        first = asyncio.create_task(worker(layer, models, m1).run())
        try:
            await until(lambda: cache.status is not None and cache.status.status == "serving", "a serving status")
            assert await gate() is None and (await switching.status_sync()).model == "m1"  # from the cache
            running = AddRequest("r-run", await layer.new_channel(), [1, 2, 3, 4], 500)
            await engine_client.request_submit(running)
            assert (await asyncio.wait_for(layer.receive(running.reply_channel), TIMEOUT))["type"] == "engine.tokens"
            models.step_gate.close()
            await asyncio.to_thread(models.step_gate.held.wait, TIMEOUT)  # the engine is mid-step
            waiting = AddRequest("r-wait", await layer.new_channel(), [5, 6, 7, 8], 4)
            await engine_client.request_submit(waiting)
            await until(lambda: "r-wait" in cache.waiting and "r-run" in cache.sent, "a beat listing both")
            first.cancel()  # the engine dies mid-step: no more heartbeats, no more tokens
            with contextlib.suppress(asyncio.CancelledError):
                await first

            while (msg := await asyncio.wait_for(layer.receive(running.reply_channel), TIMEOUT))["type"] != (
                "engine.failed"
            ):
                pass
            assert (msg["code"], msg["status"]) == ("engine_error", 503)
            msg = await asyncio.wait_for(layer.receive(waiting.reply_channel), TIMEOUT)
            assert (msg["type"], msg["code"], msg["status"], msg["retry_after"]) == (
                "engine.failed",
                "engine_unavailable",
                503,
                engine_state.RETRY_AFTER,
            )
            err = await gate()
            assert (err.code, err.status, err.headers()) == ("engine_unavailable", 503, {"Retry-After": "5"})
            assert await engine_client.engine_status() is None  # /health: unreachable

            models.step_gate.open()
            second = asyncio.create_task(worker(layer, models, m1).run())  # an engine comes back
            await until(lambda: cache.available and cache.status.status == "serving", "the new engine's status")
            assert await gate() is None and took[-1][1] is False and any(back for _, back in took[1:])
            second.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await second
        finally:
            models.step_gate.open()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    asyncio.run(asyncio.wait_for(scenario(), 6 * TIMEOUT))


def test_a_switch_is_pushed_to_the_cache_before_its_requester_hears_the_end(front_end, tmp_path):
    """The gate refuses during the switch and lets requests through once it ended, with no
    status request on the way; the cache learns the new model and the history by itself."""
    layer, cache, _ = front_end
    models = FakeModels(tmp_path)
    m1, m2 = models.model("m1"), models.model("m2")

    async def scenario():
        from engine.messages import ENGINE_CHANNEL, SwitchModel

        listener = asyncio.create_task(engine_state.engine_state_listen())
        engine = asyncio.create_task(worker(layer, models, m1).run())
        try:
            await until(lambda: cache.status is not None and cache.status.status == "serving", "a serving status")
            models.load_gate.close()
            reply = await layer.new_channel()
            await layer.send(ENGINE_CHANNEL, SwitchModel("sw-1", "m2", str(m2), reply_channel=reply).to_message())
            assert (await asyncio.wait_for(layer.receive(reply), TIMEOUT))["accepted"]
            await until(lambda: cache.status.status == "switching", "the switching state")
            err = await gate()
            assert err is not None and err.code == "model_switching"
            models.load_gate.open()
            done = await asyncio.wait_for(layer.receive(reply), TIMEOUT)
            assert done["outcome"] == "switched" and done["path"] == str(m2)
            await until(lambda: cache.status.model == "m2", "the new model in the cache")
            assert cache.status.status == "serving" and await gate() is None
            assert [s["switch_id"] for s in cache.status.recent_switches] == ["sw-1"]
        finally:
            models.load_gate.open()
            engine.cancel()
            listener.cancel()
            for task in (engine, listener):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    asyncio.run(asyncio.wait_for(scenario(), 6 * TIMEOUT))
