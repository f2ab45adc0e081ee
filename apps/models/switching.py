"""Switches from the Django side: explicit (POST /v1/models/switch), implicit (a request
naming another known model), and config reloads; plus the gate that answers 503
``model_switching`` on every other /v1 route while one runs.

The engine is the one authority on what is loaded: it accepts or refuses a
switch at once (a second one is ``switch_in_progress``) and reports how it
ended, and lists its recent finished switches in the status it pushes to every
front end (apps/core/engine_state.py): each front end's listener records the
ones it has not seen in the history (idempotent by switch id) and points its
tokenizer at the model served, so the gate and the hold read a cached status:
no round trip and no database write on a request's path.

In a fleet (docs/FLEET.md) a switch goes to one worker: the one an explicit
switch names (``worker``), else one that serves the target already (it answers
``unchanged``), else the one ``switch.fleet_policy`` picks. An implicit switch
happens only when no worker serves the model a request names. A config reload
goes to the primary worker (the default model's). Live configuration goes to
every worker (``engine_client.engine_configure``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from datetime import UTC, datetime, timedelta

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from apps.core import engine_client, engine_state
from apps.core.errors import IgnisError, ModelNotFound, ModelSwitchFailed, ModelSwitching, SwitchInProgress
from apps.core.fleet import POLICIES, Worker
from apps.models.services import (
    SwitchTarget,
    model_name_split,
    servable_lookup,
    served_model,
    served_model_for,
    served_model_update,
)
from engine.messages import ENGINE_CHANNEL, RESTORED, SWITCHED, UNCHANGED, SwitchModel
from engine.status import EngineState, EngineStatus

log = logging.getLogger("ignis.models")
_background: set[asyncio.Task] = set()
ACK_TIMEOUT = 10.0
SWITCH_RETRY_AFTER = 5


async def _record_start(sw: SwitchModel, from_id: str) -> None:
    from apps.models.models import SwitchRecord

    def create():
        try:  # a front end that read the engine's status first may have recorded it (finished) already
            SwitchRecord.objects.get_or_create(
                switch_id=sw.switch_id, defaults={"trigger": sw.trigger, "from_id": from_id, "to_id": sw.served_id}
            )
        except IntegrityError:
            pass

    await database_sync_to_async(create)()


async def _record_end(done: dict) -> None:
    from apps.models.models import SwitchRecord

    await database_sync_to_async(
        lambda: SwitchRecord.objects.filter(switch_id=done["switch_id"], outcome="").update(
            outcome=done["outcome"], reason=done["reason"], seconds=done["seconds"], finished_at=timezone.now()
        )
    )()


# Switch ids this process knows are recorded as finished (the engine's status lists its recent ones).
_recorded: set[str] = set()


def switch_history_record(finished: list[dict]) -> None:
    """Insert (or finish) the history rows of switches the engine reports as ended; idempotent by switch_id.

    Sync ORM: whichever front end reads the status first records a switch, so a
    switch is in the history even when the front end that asked for it is gone.
    """
    from apps.models.models import SwitchRecord

    for sw in finished:
        at = float(sw.get("at") or 0) or None
        finished_at = datetime.fromtimestamp(at, tz=UTC) if at else timezone.now()
        ended = {
            "outcome": sw.get("outcome") or "",
            "reason": sw.get("reason") or "",
            "seconds": sw.get("seconds"),
            "finished_at": finished_at,
        }
        fields = {"trigger": sw.get("trigger") or "", "from_id": sw.get("from") or "", "to_id": sw.get("to") or ""}
        try:
            rec, created = SwitchRecord.objects.get_or_create(switch_id=sw["switch_id"], defaults={**fields, **ended})
        except IntegrityError:  # another front end inserted it in between
            created = False
        qs = SwitchRecord.objects.filter(switch_id=sw["switch_id"])
        if created and sw.get("seconds") is not None:
            qs.update(started_at=finished_at - timedelta(seconds=float(sw["seconds"])))
        elif not created:
            qs.filter(outcome="").update(**ended)
            if fields["from_id"]:  # the engine knows what it switched from; an asker may have been behind
                qs.update(from_id=fields["from_id"])


async def switch_history_note(status: EngineStatus | None) -> None:
    """Record the finished switches in ``status`` this process has not recorded yet (cheap when none)."""
    if status is None:
        return
    fresh = [
        sw
        for sw in status.recent_switches or ()
        if isinstance(sw, dict) and sw.get("switch_id") and sw["switch_id"] not in _recorded
    ]
    if not fresh:
        return
    try:
        await database_sync_to_async(switch_history_record)(fresh)
    except Exception:
        log.exception("ignis.switch.history_failed")
        return
    _recorded.update(sw["switch_id"] for sw in fresh)


async def _wait_done(layer, reply: str, sw: SwitchModel, channel: str = ENGINE_CHANNEL) -> dict | None:
    """The engine's SwitchDone for ``sw``; the model it reports serving becomes this side's model
    (in a fleet of more than one: the routing table's for that worker, until its next beat).
    The history row is finished in the background (the listener records it too)."""
    try:
        done = await asyncio.wait_for(layer.receive(reply), timeout=24 * 3600)
    except TimeoutError:
        return None
    if done.get("path") and done.get("outcome") in (SWITCHED, RESTORED):
        engine_state.CACHE.note_model(channel, done["served_id"], done["path"])
        if len(engine_state.CACHE.workers) <= 1:
            served_model_update(served_id=done["served_id"], path=done["path"])
    _spawn(_record_end(done))
    if not engine_state.CACHE.listening:
        await status_sync()
    return done


def _spawn(coro) -> None:
    """Run ``coro`` in the background, in a fresh context: the caller may be a sync view
    (``async_to_sync`` from its request thread), whose context points sync_to_async at that
    thread's executor -- which quits when the view returns, long before the switch ends and
    _wait_done writes the history row."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_background_done)


def switch_worker(*, target_id: str, trigger: str, worker: str | None = None) -> Worker | None:
    """The worker a switch to ``target_id`` goes to (None: the one ENGINE_CHANNEL, no table here).

    A named ``worker`` (an explicit switch) or ModelNotFound; a config reload: the primary; else one
    that serves the target already, else ``switch.fleet_policy``'s pick; ModelSwitchFailed when the
    policy picks none (``none``, or every worker drains or switches).
    """
    fleet = engine_state.CACHE
    if worker is not None:
        named = [w for w in fleet.live() if w.name == worker]
        if not named:
            raise ModelNotFound(f"No live engine worker is named '{worker}'.", param="worker")
        return named[0]
    if not fleet.workers:
        return None
    if trigger == "config":
        return fleet.primary(settings.IGNIS["model.id"])
    serving = fleet.serving(target_id)
    if serving:
        return serving[0]
    policy = settings.IGNIS.get("switch.fleet_policy", "idle")
    picked = fleet.switch_candidate(policy if policy in POLICIES else "idle", target_id)
    if picked is None:
        raise ModelSwitchFailed(
            f"No engine worker serves '{target_id}' and switch.fleet_policy '{policy}' picks none to switch."
        )
    return picked


async def model_switch(
    *,
    target: SwitchTarget,
    trigger: str = "explicit",
    config: dict | None = None,
    wait: bool = False,
    worker: str | None = None,
) -> dict:
    """Ask the engine (in a fleet: the worker ``switch_worker`` picks) to switch to ``target``.

    Returns the switch's description at once (``wait=False``: the rest runs in
    the background and is recorded) or once it ended (``wait=True``: the
    engine's SwitchDone). A switch already running raises SwitchInProgress.
    """
    picked = switch_worker(target_id=target.served_id, trigger=trigger, worker=worker)
    channel = picked.channel if picked is not None else ENGINE_CHANNEL
    layer = get_channel_layer()
    # The default prefix: channels_redis pops every process-specific channel of one prefix under
    # one receive lock, so a long wait here must share its prefix with the other replies.
    reply = await layer.new_channel()
    sw = SwitchModel(
        switch_id=f"switch-{uuid.uuid4().hex[:16]}",
        served_id=target.served_id,
        path=str(target.path),
        sha256=target.sha256,
        config=config or {},
        trigger=trigger,
        reply_channel=reply,
        refuse=target.refuse,
    )
    from_id = picked.model if picked is not None else served_model().served_id
    await layer.send(channel, sw.to_message())
    try:
        ack = await asyncio.wait_for(layer.receive(reply), ACK_TIMEOUT)
    except TimeoutError:
        raise ModelSwitchFailed("The engine did not answer the switch request.") from None
    if not ack.get("accepted"):
        raise SwitchInProgress("A model switch is already running; wait for it to end.")
    described = {
        "id": sw.switch_id,
        "object": "model.switch",
        "from": from_id,
        "to": sw.served_id,
        "trigger": trigger,
        "status": "switching",
    }
    if picked is not None and picked.worker_id:
        described["worker"] = picked.name
    if ack.get("unchanged"):  # it serves already: answered at once, no SwitchDone, not in the history
        return {**described, "status": "done", "outcome": UNCHANGED, "reason": ack.get("message", ""), "seconds": 0.0}
    await _record_start(sw, from_id)
    if wait:
        done = await _wait_done(layer, reply, sw, channel)
        return {**described, **(done or {}), "status": "done"}
    _spawn(_wait_done(layer, reply, sw, channel))
    return described


def _background_done(task: asyncio.Task) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("ignis.switch.record_failed", exc_info=task.exception())


async def status_sync() -> EngineStatus | None:
    """The engine's status (pushed: apps/core/engine_state.py; asked for where no listener
    runs); the model it names becomes the one this side tokenizes for."""
    status = await engine_client.engine_status_now()
    if not engine_state.CACHE.listening:  # else the listener records the history, off the request path
        await switch_history_note(status)
    if status is not None and status.model and status.path:
        served = served_model()
        if status.model != served.served_id or str(served.path) != status.path:
            served_model_update(served_id=status.model, path=status.path)
    return status


def _switching() -> ModelSwitching:
    return ModelSwitching("The server is switching models; retry shortly.", retry_after=SWITCH_RETRY_AFTER)


def _refuse_while_switching(status: EngineStatus | None) -> None:
    if status is not None and status.status is EngineState.SWITCHING:
        raise _switching()


def _refuse_while_gone() -> None:
    if not engine_state.engine_available():
        raise IgnisError(
            "The engine is not answering; retry shortly.",
            type="server_error",
            code="engine_unavailable",
            status=503,
            retry_after=engine_state.RETRY_AFTER,
        )


async def model_hold(*, name: str | None) -> None:
    """Before a chat completion, response or decision: make ``name`` the serving model.

    No name, or the serving model's, passes at once (an unloaded model is
    loaded by the engine when the request arrives). Another known model starts
    an implicit switch and holds the request until it serves; one that does not
    land is 503 ``model_switch_failed`` (no Retry-After), and the request is
    never answered by another model. With implicit switching off, or for an
    unknown name, ``model_name_resolve`` answers 404 afterwards.
    """
    if not isinstance(name, str):
        return
    served_id, _ = model_name_split(name)
    status = await status_sync()  # the cached status: no round trip where a listener runs
    if not served_id:
        return
    fleet = engine_state.CACHE
    if len(fleet.workers) > 1:  # a fleet (docs/FLEET.md): a switch only when no worker serves it
        if fleet.serving(served_id):
            return
        if any(w.model == served_id for w in fleet.live()):
            raise _switching()  # its workers are switching or draining: back shortly
    elif served_id == served_model().served_id:
        return
    if not settings.IGNIS["switch.allow_implicit"]:
        return
    _refuse_while_gone()
    _refuse_while_switching(status)
    target = await database_sync_to_async(servable_lookup)(served_id)
    try:
        done = await model_switch(target=target, trigger="implicit", wait=True)
    except SwitchInProgress:
        raise _switching() from None
    if done.get("outcome") != SWITCHED or (served_model().served_id != served_id and not fleet.serving(served_id)):
        raise ModelSwitchFailed(
            f"The switch to '{served_id}' did not land ({done.get('outcome')}): "
            f"{done.get('reason') or 'no reason given'}."
        )


# Routes a running switch does not refuse: reads of state, and the switch route itself (409).
GATE_EXEMPT = {("GET", "/v1/models"), ("POST", "/v1/models/switch"), ("GET", "/v1/config"), ("GET", "/v1/catalog")}


async def switch_gate(*, method: str, path: str) -> None:
    """For a /v1 route: 503 engine_unavailable while the engine misses its heartbeats, 503
    model_switching (Retry-After: 5) while a switch runs. Reads the pushed status
    (apps/core/engine_state.py): no round trip, no database write."""
    if not path.startswith("/v1/") or (method, path.rstrip("/")) in GATE_EXEMPT or _is_model_read(method, path):
        return
    _refuse_while_gone()
    fleet = engine_state.CACHE
    if len(fleet.workers) > 1:  # a fleet: only when no worker can take anything
        if all(w.state is EngineState.SWITCHING for w in fleet.live()):
            raise _switching()
        return
    _refuse_while_switching(engine_state.engine_state())


def _is_model_read(method: str, path: str) -> bool:
    """GET /v1/models/{id} reads state, like GET /v1/models."""
    return method == "GET" and path.startswith("/v1/models/")


async def status_took(status: EngineStatus) -> None:
    """The engine state listener's hook (apps/core/engine_state.py STATUS_HOOKS, registered by
    ModelsConfig.ready): record finished switches, point this side's tokenizer at the model
    the engine serves and load it on a thread before a request needs it."""
    await switch_history_note(status)
    if status.model and status.path:
        served = served_model()
        if status.model != served.served_id or str(served.path) != status.path:
            served = served_model_update(served_id=status.model, path=status.path)
        if "tokenizer" not in served.__dict__:
            await asyncio.to_thread(lambda: served.tokenizer)
    for model, workers in engine_state.CACHE.models().items():  # a fleet: every model a worker serves
        if workers[0].status.path:
            other = served_model_for(served_id=model, path=workers[0].status.path)
            if "tokenizer" not in other.__dict__:
                await asyncio.to_thread(lambda m=other: m.tokenizer)
