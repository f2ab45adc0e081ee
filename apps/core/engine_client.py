"""The Django side's only door to the engine: messages on the Channels layer.

In a fleet (docs/FLEET.md) each message goes to the worker the routing table
(apps/core/fleet.py) names: a request to one serving its model, its abort to
the worker it went to, live configuration to every worker. Without a listener
(management commands, unit tests) everything goes to ENGINE_CHANNEL as before.
"""

from __future__ import annotations

import asyncio
import dataclasses

from channels.layers import get_channel_layer

from apps.core import engine_state
from apps.core.fleet import default_model
from engine.messages import ENGINE_CHANNEL, AbortRequest, AddRequest, ConfigureEngine, RequestFailed, RequestFinished
from engine.status import EngineStatus

# Parts of the reply the engine sends only while a scheduler exists (a model is loaded).
_LOADED_ONLY = ("stats", "lanes")
# The parts that carry what clients named (switch targets, reasons quoting them): kept by the
# history and echoed by /health and /v1/models, so every string in them is cut to ECHO_CHARS.
_ECHOED = ("error", "switching", "last_switch", "recent_switches")
ECHO_CHARS = 512


async def request_submit(add: AddRequest) -> None:
    """Send ``add`` to a worker serving ``add.model`` (ended or sent again here should it go)."""
    msg = add.to_message()
    await get_channel_layer().send(engine_state.request_route(msg), msg)


_LAST = frozenset({RequestFinished.TYPE, RequestFailed.TYPE})


def reply_heard(message: dict) -> None:
    """A consumer got ``message`` on its reply channel: a request's last one (engine.finished or
    engine.failed) takes it out of the fleet's table here, so a worker that leaves (or goes silent)
    afterwards has nothing of it to end. Consumers call this as each message arrives."""
    if message.get("type") in _LAST and isinstance(message.get("request_id"), str):
        engine_state.request_done(message["request_id"])


async def request_abort(request_id: str) -> None:
    """Abort ``request_id`` on the worker it went to (every worker when this side no longer knows)."""
    channel = engine_state.request_done(request_id)
    channels = [channel] if channel is not None else worker_channels()
    layer = get_channel_layer()
    for target in channels:
        await layer.send(target, AbortRequest(request_id=request_id).to_message())


def worker_channels() -> list[str]:
    """Every live worker's channel (ENGINE_CHANNEL where no table is kept, or none is known)."""
    return [w.channel for w in engine_state.CACHE.live()] or [ENGINE_CHANNEL]


async def engine_configure(values: dict) -> None:
    """Live engine settings (ConfigureEngine) to every worker."""
    layer = get_channel_layer()
    for channel in worker_channels():
        await layer.send(channel, ConfigureEngine(values=values).to_message())


async def engine_status(timeout: float = 2.0) -> EngineStatus | None:
    """The engine's status as of now (GET /health, the Monitor, /metrics: fresh counters),
    asked for; None at once while the heartbeats say the engine is gone
    (apps/core/engine_state.py). Request paths read the pushed status instead."""
    if not engine_state.engine_available():
        return None
    return await engine_status_ask(timeout)


async def engine_status_ask(timeout: float = 2.0, channel: str | None = None) -> EngineStatus | None:
    """Ask the engine (the worker on ``channel``; default: the primary one) for its status; None when
    it does not answer in time."""
    layer = get_channel_layer()
    reply = await layer.new_channel()  # the default prefix: see apps.models.switching.model_switch
    if channel is None:
        primary = engine_state.CACHE.primary(default_model())
        channel = primary.channel if primary is not None else ENGINE_CHANNEL
    await layer.send(channel, {"type": EngineStatus.TYPE, "reply_channel": reply})
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
