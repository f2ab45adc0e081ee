"""The Django side's only door to the engine: messages on the Channels layer."""

from __future__ import annotations

import asyncio
import dataclasses

from channels.layers import get_channel_layer

from apps.core import engine_state
from engine.messages import ENGINE_CHANNEL, AbortRequest, AddRequest
from engine.status import EngineStatus

# Parts of the reply the engine sends only while a scheduler exists (a model is loaded).
_LOADED_ONLY = ("stats", "lanes")
# The parts that carry what clients named (switch targets, reasons quoting them): kept by the
# history and echoed by /health and /v1/models, so every string in them is cut to ECHO_CHARS.
_ECHOED = ("error", "switching", "last_switch", "recent_switches")
ECHO_CHARS = 512


async def request_submit(add: AddRequest) -> None:
    engine_state.request_sent(add.request_id, add.reply_channel)  # ended here should the engine go
    await get_channel_layer().send(ENGINE_CHANNEL, add.to_message())


async def request_abort(request_id: str) -> None:
    engine_state.request_done(request_id)
    await get_channel_layer().send(ENGINE_CHANNEL, AbortRequest(request_id=request_id).to_message())


async def engine_status(timeout: float = 2.0) -> EngineStatus | None:
    """The engine's status as of now (GET /health, the Monitor, /metrics: fresh counters),
    asked for; None at once while the heartbeats say the engine is gone
    (apps/core/engine_state.py). Request paths read the pushed status instead."""
    if not engine_state.engine_available():
        return None
    return await engine_status_ask(timeout)


async def engine_status_ask(timeout: float = 2.0) -> EngineStatus | None:
    """Ask the engine for its status; None when it does not answer in time."""
    layer = get_channel_layer()
    reply = await layer.new_channel()  # the default prefix: see apps.models.switching.model_switch
    await layer.send(ENGINE_CHANNEL, {"type": EngineStatus.TYPE, "reply_channel": reply})
    try:
        msg = await asyncio.wait_for(layer.receive(reply), timeout)
    except TimeoutError:
        return None
    status = EngineStatus.from_message(msg)
    return dataclasses.replace(status, **{name: _bounded(getattr(status, name)) for name in _ECHOED})


def _bounded(value):
    """``value`` with every string in it cut to ECHO_CHARS characters (an ellipsis marks a cut)."""
    if isinstance(value, str):
        return value if len(value) <= ECHO_CHARS else value[: ECHO_CHARS - 1] + "\u2026"
    if isinstance(value, dict):
        return {k: _bounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bounded(v) for v in value]
    return value


def engine_status_payload(status: EngineStatus | None) -> dict | None:
    """``status`` as the engine's reply reads on the wire (GET /health's ``engine``).

    The same keys in the same order: ``type`` first, and ``stats`` and
    ``lanes`` left out while nothing is loaded rather than sent as null.
    """
    if status is None:
        return None
    msg = status.to_message()
    head = {"type": msg.pop("type")}
    return head | {k: v for k, v in msg.items() if not (k in _LOADED_ONLY and v is None)}


async def engine_status_now() -> EngineStatus | None:
    """The cached status where a listener runs (None: the engine is gone); else a round trip."""
    if engine_state.CACHE.listening:
        return engine_state.engine_state()
    return await engine_status_ask()
