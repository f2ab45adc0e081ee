"""The front end's cached engine status, fed by the engine's heartbeats.

The engine publishes an EngineHeartbeat (engine/messages.py) to the group
STATUS_GROUP whenever its state, served model or switch history changes, and
every ``server.engine_heartbeat`` seconds. Every serving front end joins that
group for its life (``engine_state_listen``, started by ``serve`` beside
``config_listen``) and keeps the last status here, so requests answer from it:
no status round trip and no database write sits on a request's path. The
listener does the work a status used to trigger on the request path: it points
this side's tokenizer at the model the engine serves (and loads it, on a
thread, before a request needs it), and records the switches
the engine reports finished in the history: apps.models registers both as
``STATUS_HOOKS`` (``apps.models.switching.status_took``), so this bottom module
imports no app.

Liveness: with no heartbeat for ``server.engine_timeout`` seconds the engine
is taken for gone. New requests are then 503 ``engine_unavailable`` with
Retry-After (``switch_gate``), and the requests this front end sent end: the
ones the last heartbeat listed as waiting with ``engine_unavailable``, the
others (they streamed, or were sent since) with ``engine_error``
(``request_sent`` keeps their reply channels; the engine beats soon after a
request's first token, so the list is seldom behind). The next
heartbeat, from this engine or a restarted one, makes it available again.

Without a listener (management commands, unit tests) nothing is cached and
``engine_client.engine_status_now`` asks the engine as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable

from channels.layers import get_channel_layer
from django.conf import settings

from apps.core.groups import join_forever
from engine.messages import STATUS_GROUP, EngineHeartbeat, RequestFailed
from engine.status import EngineStatus

log = logging.getLogger("ignis.engine_state")
RETRY_AFTER = 5  # seconds a request refused while the engine is gone is told to wait


class EngineStateCache:
    """The last heartbeat, when it came, and the requests sent since (to end them if the engine goes)."""

    def __init__(self) -> None:
        self.listening = False
        self.status: EngineStatus | None = None
        self.engine_id: str | None = None
        self.seen_at: float | None = None  # monotonic time of the last heartbeat
        self.available = False
        self.waiting: set[str] = set()  # the last heartbeat's waiting_request_ids
        self.sent: dict[str, tuple[str, float]] = {}  # request_id -> (reply channel, when sent)

    def take(self, beat: EngineHeartbeat, now: float) -> bool:
        """Cache ``beat``; True when the engine was unavailable (or unseen) before it."""
        came_back = not self.available
        self.status = EngineStatus.from_message(beat.status)
        self.engine_id, self.seen_at, self.available = beat.engine_id, now, True
        self.waiting = set(beat.waiting_request_ids)
        # A request the engine does not list has finished, unless it was sent so recently
        # that the engine may not have had it when it wrote this heartbeat.
        live = self.waiting | set(beat.running_request_ids)
        grace = 2 * max(beat.heartbeat, 0.5)
        self.sent = {rid: v for rid, v in self.sent.items() if rid in live or now - v[1] < grace}
        return came_back

    def expired(self, now: float, timeout: float) -> bool:
        return self.available and self.seen_at is not None and now - self.seen_at > timeout


CACHE = EngineStateCache()
_ORIGIN = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def engine_state() -> EngineStatus | None:
    """The engine's last pushed status; None when none came yet or the engine is gone."""
    return CACHE.status if CACHE.available else None


def engine_available() -> bool:
    """False only while a listener runs and the engine missed its heartbeats (or never sent one)."""
    return CACHE.available or not CACHE.listening


def request_sent(request_id: str, reply_channel: str) -> None:
    """The engine client sent this request: it ends here should the engine go."""
    if CACHE.listening:
        CACHE.sent[request_id] = (reply_channel, time.monotonic())


def request_done(request_id: str) -> None:
    CACHE.sent.pop(request_id, None)


async def _end_sent(layer) -> None:
    """The engine is gone: every request it held ends, each the way docs/API.md says."""
    sent, CACHE.sent = CACHE.sent, {}
    for request_id, (channel, _) in sent.items():
        # Waiting at the last heartbeat: not begun, so 503 engine_unavailable. Anything else (it
        # streamed, or was sent after that beat) may have begun: an engine_error event ends it.
        if request_id not in CACHE.waiting:
            failed = RequestFailed(request_id, "The engine stopped answering while this request ran.", "engine_error")
        else:
            failed = RequestFailed(
                request_id,
                "The engine is not answering; retry shortly.",
                "engine_unavailable",
                retry_after=RETRY_AFTER,
            )
        try:
            await layer.send(channel, failed.to_message())
        except Exception:
            log.exception("ignis.engine.end_failed", extra={"request_id": request_id})


# What a heartbeat triggers off the request path, registered by the apps that care
# (apps.models: the served model and the switch history, ModelsConfig.ready).
STATUS_HOOKS: list[Callable[[EngineStatus], Awaitable[None]]] = []


async def _took(beat: EngineHeartbeat, came_back: bool) -> None:
    status = CACHE.status
    if came_back:
        log.info("ignis.engine.available", extra={"engine_id": beat.engine_id, "status": str(status.status)})
    for hook in STATUS_HOOKS:
        await hook(status)


async def _watch(layer) -> None:
    """Mark the engine gone after ``server.engine_timeout`` seconds without a heartbeat."""
    tick = time.monotonic()
    while True:
        timeout = float(settings.IGNIS.get("server.engine_timeout", 5.0))
        interval = min(timeout / 4, 0.5)
        await asyncio.sleep(interval)
        now, last = time.monotonic(), tick
        tick = now
        if now - last > 2 * interval:
            continue  # this loop stalled, not (for all we know) the engine: its beats may be queued here
        if CACHE.expired(now, timeout):
            CACHE.available = False
            log.warning("ignis.engine.unavailable", extra={"engine_id": CACHE.engine_id, "silent_for": timeout})
        if not CACHE.available and CACHE.sent:
            await _end_sent(layer)


async def engine_state_listen() -> None:
    """Every ``serve`` process runs this for its life: join STATUS_GROUP, cache each heartbeat."""
    layer = get_channel_layer()
    channel = f"ignis.engine_state.{_ORIGIN}"  # a plain channel: see config_service.config_listen

    CACHE.listening = True
    tasks = [
        asyncio.ensure_future(join_forever(layer, STATUS_GROUP, channel, log, "ignis.engine_state.group_add_failed")),
        asyncio.ensure_future(_watch(layer)),
    ]
    try:
        while True:
            try:
                msg = await layer.receive(channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("ignis.engine_state.receive_failed")
                await asyncio.sleep(1)
                continue
            if msg.get("type") != EngineHeartbeat.TYPE:
                continue
            beat = EngineHeartbeat.from_message(msg)
            came_back = CACHE.take(beat, time.monotonic())
            try:
                await _took(beat, came_back)
            except Exception:
                log.exception("ignis.engine_state.note_failed")
    finally:
        CACHE.listening = False
        for task in tasks:
            task.cancel()
