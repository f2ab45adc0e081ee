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

Every worker of a fleet beats on that group; the cache is the fleet's routing
table (apps/core/fleet.py, docs/FLEET.md), and ``engine_state()`` reads as the
primary worker's status (embedded: the one engine's).

Liveness: a worker with no heartbeat for ``server.worker_timeout`` seconds
(0: ``server.engine_timeout``) leaves the table, and the requests this front
end sent it end (``_end_orphans``): the ones its last heartbeat listed as
waiting are sent again to a live worker of their model, or answered
``engine_unavailable``; the others (they streamed, or were sent since) end with
``engine_error`` (``request_route`` keeps their reply channels; a worker beats
soon after a request's first token, so the list is seldom behind). With no
worker left, new requests are 503 ``engine_unavailable`` with Retry-After
(``switch_gate``). The next heartbeat, from this worker or a restarted one,
puts it back.

A drained worker's ``leaving`` beat takes it out of the routing at once; it has
answered everything it took. As a net under that, what this front end sent it
and has not seen the last message of (consumers call ``engine_client.reply_heard``
as each message arrives) ends with ``engine_error`` ``server.worker_timeout``
seconds later (``_end_left``), or at once should it come back under its id first.
Not at the beat itself: a consumer may still have that last message queued behind
the stream's tokens, and an end sent then could overtake it (channels_redis
orders a channel's messages by each sender's clock).

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

from apps.core.fleet import Fleet, Sent, Worker
from apps.core.groups import join_forever
from engine.messages import ENGINE_CHANNEL, STATUS_GROUP, EngineHeartbeat, RequestFailed
from engine.status import EngineStatus

log = logging.getLogger("ignis.engine_state")
RETRY_AFTER = 5  # seconds a request refused while the engine is gone is told to wait


# The routing table (apps/core/fleet.py) is the cache: ``status`` reads as the primary worker's
# (a fleet of one: the engine's), ``available`` as "some worker answers".
EngineStateCache = Fleet
CACHE = Fleet()
_ORIGIN = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def engine_state() -> EngineStatus | None:
    """The engine's last pushed status; None when none came yet or the engine is gone."""
    return CACHE.status if CACHE.available else None


def engine_available() -> bool:
    """False only while a listener runs and every worker missed its heartbeats (or none sent one)."""
    return CACHE.available or not CACHE.listening


def worker_timeout() -> float:
    """Seconds of silence that take a worker out of the table (server.worker_timeout, 0: engine_timeout)."""
    cfg = settings.IGNIS
    return float(cfg.get("server.worker_timeout") or 0) or float(cfg.get("server.engine_timeout", 5.0))


def request_route(add_message: dict) -> str:
    """The channel an AddRequest goes to (the worker serving its model), noted so it can be ended or
    sent again should that worker go."""
    channel = CACHE.channel_for(add_message.get("model"))
    if CACHE.listening:
        CACHE.record(add_message["request_id"], channel, add_message, time.monotonic())
    return channel


def request_sent(request_id: str, reply_channel: str) -> None:
    """The engine client sent this request (to the one engine channel): it ends here should the engine go."""
    if CACHE.listening:
        CACHE.record(request_id, ENGINE_CHANNEL, {"reply_channel": reply_channel}, time.monotonic())


def request_done(request_id: str) -> str | None:
    """The request ended on this side; the channel of the worker it went to (None: not known here)."""
    sent = CACHE.sent.pop(request_id, None)
    return sent.channel if sent is not None else None


async def _end_orphans(layer, worker: Worker | None, orphans: dict[str, Sent], *, left: bool = False) -> None:
    """``worker`` is gone (or restarted): each request it held ends the way docs/FLEET.md says,
    or, queued and not begun, is sent again to a live worker serving its model. ``left``: it said
    goodbye (a leaving beat) after answering everything it held, so what is still open here ends
    with engine_error, never sent again (its client may well have had its answer already)."""
    waiting = worker.waiting if worker is not None else set(orphans)  # none known: none can have begun
    if left:
        waiting = set()
    for request_id, sent in orphans.items():
        # Waiting at the last heartbeat: not begun. Anything else (it streamed, or was sent after
        # that beat) may have begun: an engine_error event ends it.
        if request_id in waiting:
            target = CACHE.route(sent.message.get("model")) if "prompt_token_ids" in sent.message else None
            if target is not None:
                try:
                    await layer.send(target.channel, sent.message)
                    CACHE.record(request_id, target.channel, sent.message, time.monotonic())
                    log.info(
                        "ignis.fleet.resent",
                        extra={"request_id": request_id, "from": worker.name, "to": target.name},
                    )
                    continue
                except Exception:
                    log.exception("ignis.fleet.resend_failed", extra={"request_id": request_id})
            failed = RequestFailed(
                request_id,
                "The engine is not answering; retry shortly.",
                "engine_unavailable",
                retry_after=RETRY_AFTER,
            )
        elif left:
            failed = RequestFailed(request_id, "The engine worker left before this request finished.", "engine_error")
        else:
            failed = RequestFailed(request_id, "The engine stopped answering while this request ran.", "engine_error")
        try:
            await layer.send(sent.reply_channel, failed.to_message())
        except Exception:
            log.exception("ignis.engine.end_failed", extra={"request_id": request_id})


# What a heartbeat triggers off the request path, registered by the apps that care
# (apps.models: the served model and the switch history, ModelsConfig.ready).
STATUS_HOOKS: list[Callable[[EngineStatus], Awaitable[None]]] = []


async def _took(beat: EngineHeartbeat, came_back: bool) -> None:
    status = CACHE.status
    if status is None:  # the last worker said goodbye (a leaving beat): nothing to follow
        return
    if came_back:
        log.info("ignis.engine.available", extra={"engine_id": beat.engine_id, "status": str(status.status)})
    for hook in STATUS_HOOKS:
        await hook(status)


async def _watch(layer) -> None:
    """Take a worker out of the table after ``server.worker_timeout`` seconds without its heartbeat."""
    tick = time.monotonic()
    while True:
        timeout = worker_timeout()
        interval = min(timeout / 4, 0.5)
        await asyncio.sleep(interval)
        now, last = time.monotonic(), tick
        tick = now
        if now - last > 2 * interval:
            continue  # this loop stalled, not (for all we know) the engine: its beats may be queued here
        for worker in CACHE.expire(now, timeout):
            log.warning(
                "ignis.engine.unavailable" if not CACHE.available else "ignis.fleet.worker_gone",
                extra={"engine_id": worker.engine_id, "worker_id": worker.name, "silent_for": timeout},
            )
            await _end_orphans(layer, worker, CACHE.orphans(worker.channel))
        for channel in CACHE.departed_due(now, timeout):
            await _end_left(layer, channel)
        if not CACHE.available and CACHE.sent:  # sent while no worker was known
            await _end_orphans(layer, None, CACHE.unrouted())


async def _heard(layer, beat: EngineHeartbeat) -> bool:
    """Take ``beat`` into the table (True: no worker was available before it). What this front end
    sent a worker that restarted (or left and is back) and that is still open here ends first."""
    old = CACHE.restarted(beat)
    if old is not None:  # the same worker id, another engine: what the old one held is lost
        log.warning("ignis.fleet.worker_restarted", extra={"worker_id": old.name, "engine_id": beat.engine_id})
        await _end_orphans(layer, old, CACHE.orphans(old.channel))
    elif beat.leaving:
        log.info("ignis.fleet.worker_left", extra={"worker_id": beat.worker_id or "engine"})
    elif beat.channel in CACHE.departed:  # back under its id before the net fell due: it falls now
        CACHE.departed.pop(beat.channel)
        await _end_left(layer, beat.channel)
    return CACHE.take(beat, time.monotonic())


async def _end_left(layer, channel: str) -> None:
    """The net under a drain: the worker on ``channel`` said goodbye ``server.worker_timeout`` seconds
    ago (or came back since), having answered all it took; what this front end sent it and has
    still not heard the last message of ends with engine_error."""
    orphans = CACHE.orphans(channel)
    if orphans:
        log.warning("ignis.fleet.left_open", extra={"channel": channel, "open": len(orphans)})
        await _end_orphans(layer, None, orphans, left=True)


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
            came_back = await _heard(layer, beat)
            try:
                await _took(beat, came_back)
            except Exception:
                log.exception("ignis.engine_state.note_failed")
    finally:
        CACHE.listening = False
        for task in tasks:
            task.cancel()
