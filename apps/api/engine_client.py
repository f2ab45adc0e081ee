"""The Django side's only door to the engine: messages on the Channels layer."""

from __future__ import annotations

import asyncio

from channels.layers import get_channel_layer

from engine.messages import ENGINE_CHANNEL, AbortRequest, AddRequest


async def request_submit(add: AddRequest) -> None:
    await get_channel_layer().send(ENGINE_CHANNEL, add.to_message())


async def request_abort(request_id: str) -> None:
    await get_channel_layer().send(ENGINE_CHANNEL, AbortRequest(request_id=request_id).to_message())


async def engine_status(timeout: float = 2.0) -> dict | None:
    """Ask the engine for its status; None when it does not answer in time."""
    layer = get_channel_layer()
    reply = await layer.new_channel()  # the default prefix: see apps.models.switching.model_switch
    await layer.send(ENGINE_CHANNEL, {"type": "engine.status", "reply_channel": reply})
    try:
        return await asyncio.wait_for(layer.receive(reply), timeout)
    except TimeoutError:
        return None
