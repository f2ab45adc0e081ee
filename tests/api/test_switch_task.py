"""An explicit switch's background task outlives the request that started it.

POST /v1/models/switch is a sync DRF view: Django runs it in the request's
thread and it calls ``async_to_sync(model_switch)``; the task that waits for the
engine's SwitchDone and records it runs after the view returned, so it must not
inherit the request's thread executor (it did: "Task exception was never
retrieved ... CurrentThreadExecutor already quit" on every explicit switch).
The engine here is the test, on the in-memory channel layer; the history rows
are written through ``database_sync_to_async`` as the real ones are, into a list.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from asgiref.sync import ThreadSensitiveContext, async_to_sync, sync_to_async
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from apps.core import engine_client
from apps.models import switching
from apps.models.services import SwitchTarget
from engine.messages import ENGINE_CHANNEL


def test_explicit_switch_records_its_end_after_the_view_returned(monkeypatch):
    rows: dict[str, dict] = {}

    async def no_engine_status(timeout: float = 2.0):
        return None

    async def record_start(sw, from_id):
        await database_sync_to_async(rows.__setitem__)(sw.switch_id, {"to": sw.served_id, "trigger": sw.trigger})

    async def record_end(done):
        await database_sync_to_async(rows[done["switch_id"]].update)(outcome=done["outcome"], seconds=done["seconds"])

    monkeypatch.setattr(engine_client, "engine_status", no_engine_status)
    monkeypatch.setattr(switching, "_record_start", record_start)
    monkeypatch.setattr(switching, "_record_end", record_end)
    target = SwitchTarget("other-model", Path("/nowhere/other.gguf"))

    def view() -> dict:  # what models_switch does in its request thread
        return async_to_sync(switching.model_switch)(target=target, trigger="explicit")

    async def main() -> None:
        layer = get_channel_layer()

        async def engine_accepts() -> dict:
            msg = await layer.receive(ENGINE_CHANNEL)
            await layer.send(msg["reply_channel"], {"type": "engine.switch_ack", "accepted": True})
            return msg

        engine = asyncio.ensure_future(engine_accepts())
        async with ThreadSensitiveContext():  # as Django's ASGI handler serves a request
            described = await sync_to_async(view)()
        sw = await engine
        assert described["status"] == "switching" and described["id"] == sw["switch_id"]
        tasks = list(switching._background)
        assert tasks, "the switch runs on in the background"
        await layer.send(
            sw["reply_channel"],
            {
                "type": "engine.switch_done",
                "switch_id": sw["switch_id"],
                "outcome": "switched",
                "reason": "",
                "seconds": 1.5,
            },
        )
        await asyncio.wait_for(asyncio.gather(*tasks), 10)  # raises what the task raised

    asyncio.run(main())
    [row] = rows.values()
    assert row == {"to": "other-model", "trigger": "explicit", "outcome": "switched", "seconds": 1.5}
