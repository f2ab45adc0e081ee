"""The model host: the one loaded model's life, as a state machine over EngineState.

Each transition is one method; ``state`` changes only in ``_enter``,
``accept_switch`` and ``_end_switch``::

    method          from                       to
    start           LOADING                    SERVING | FAILED
    reload          UNLOADED | FAILED          LOADING, then SERVING | FAILED
    unload          SERVING (idle, or asked)   UNLOADED
    accept_switch   any but SWITCHING          SWITCHING (SERVING stays SERVING when the
                                               switch names what serves: a no-op)
    run_switch      SWITCHING                  refused by the precheck: the state it left,
                                                 nothing torn down; else drained, torn down, and
                                               switched: SERVING (the new model loaded)
                                               restored: SERVING (it failed; the old one reloaded)
                                               failed:   FAILED (that failed too, or none served)

Every change of ``state`` (and every finished switch) calls ``changed()``: the
worker then publishes the status to every front end (EngineHeartbeat).

A switch is accepted at once (on the receive loop), so it can arrive while a
load or a teardown is in flight: the state then reads SWITCHING at once, and
what that transition leaves is where the switch resumes from (``_enter``).

The loop (engine/worker.py) asks between steps which transition is due and
runs it; loads and teardowns run on the step thread, so the event loop keeps
answering ``engine.status``. The loader and the backend factory are
injectable (tests run the host on the fake backend).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import asdict
from pathlib import Path

from engine import gc_pause
from engine.backend import Backend
from engine.config import EngineConfig
from engine.loading import BackendFactory, Loader, create_backend, load_artifact, load_model
from engine.memory import EMPTY_PLAN
from engine.messages import (
    FAILED,
    REFUSED,
    RESTORED,
    SWITCHED,
    AddRequest,
    RequestFailed,
    SwitchAck,
    SwitchDone,
    SwitchModel,
)
from engine.refusals import refusal
from engine.scheduler import Scheduler
from engine.status import EngineState, EngineStatus
from engine.switching import LIVE_FIELDS, SwitchRefused, switch_precheck
from engine.telemetry import TELEMETRY, lanes_snapshot

log = logging.getLogger("ignis.engine")

SWITCH_RETRY_AFTER = 5  # seconds a request refused during a switch is told to wait

S = EngineState


class ModelHost:
    """Load, teardown, switch, idle unload and reload of the one model.

    ``send(channel, msg)`` answers a switch's requester (SwitchAck, SwitchDone);
    ``end_requests(request_ids, message)`` ends live requests with engine_error
    (the worker knows where their replies go); ``wake()`` wakes the loop when a
    switch's precheck finishes.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        artifact_path: str | Path,
        served_id: str,
        *,
        step_thread: Executor,
        send: Callable[[str, dict], Awaitable[None]],
        end_requests: Callable[[list[str], str], Awaitable[None]],
        wake: Callable[[], None],
        announce: Callable[[], Awaitable[None]] | None = None,
        changed: Callable[[], None] | None = None,
        idle_unload: float = 0,
        drain_timeout: float = 30.0,
        ram_budget: int = 0,
        on_progress: Callable[[str, int, int], None] | None = None,
        loader: Loader | None = None,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        self.cfg = cfg
        self.artifact_path = Path(artifact_path)
        self.served_id = served_id
        self._changed = changed or (lambda: None)
        self._announce = announce
        self.state = S.LOADING
        self.error: str | None = None
        self.backend: Backend | None = None
        self.scheduler: Scheduler | None = None
        self.max_context = cfg.max_context
        self.requested_max_context = cfg.max_context  # a load clamps cfg.max_context to the model's own
        self.idle_unload = float(idle_unload)
        self.drain_timeout = float(drain_timeout)
        self.ram_budget = int(ram_budget)
        self.on_progress = on_progress
        self.load_progress: dict | None = None
        self.switching: dict | None = None  # {from, to} while a switch runs
        self.last_switch: dict | None = None
        self.recent_switches: deque[dict] = deque(maxlen=32)  # finished switches, with their switch_id
        self.switch_outcomes: dict[str, int] = {}  # switched | refused | restored | failed -> count
        self._thread = step_thread
        self._send, self._end_requests, self._wake = send, end_requests, wake
        self._loader, self._backend_factory = loader or load_artifact, backend_factory or create_backend
        self._pending: SwitchModel | None = None
        self._precheck: asyncio.Task | None = None
        self._resume = S.LOADING  # under a switch: the state it left (a refusal goes back there)
        self._drain_deadline = 0.0
        self._last_active = time.monotonic()
        self._unload_wanted = False

    @property
    def state(self) -> EngineState:
        return self._state

    @state.setter
    def state(self, value: EngineState) -> None:
        """Every change is announced to the front ends (``changed()``: the worker publishes)."""
        if getattr(self, "_state", None) is not value:
            self._state = value
            self._changed()

    # -- what the loop asks between steps ----------------------------------------------

    @property
    def needs_load(self) -> bool:
        """Nothing is loaded and no switch runs: the next request reloads the model."""
        return self.state in (S.UNLOADED, S.FAILED)

    def refusal_for(self, add: AddRequest) -> RequestFailed | None:
        """Why ``add`` cannot go to the scheduler now (None: it can)."""
        if self.state is S.SWITCHING:
            return refusal("model_switching", add.request_id, retry_after=SWITCH_RETRY_AFTER)
        if self.state is not S.SERVING:
            return self.load_failed(add.request_id)
        if add.model and add.model.split("@")[0] != self.served_id:
            text = f"The model changed to '{self.served_id}' while this request was prepared; retry it."
            return refusal("model_switching", add.request_id, text, retry_after=SWITCH_RETRY_AFTER)
        return None

    def load_failed(self, request_id: str) -> RequestFailed:
        return refusal("model_load_failed", request_id, f"The model failed to load: {self.error}")

    def switch_ready(self) -> bool:
        """A switch's precheck is done, and so is the drain (nothing running, or its timeout passed)."""
        if self._precheck is None or not self._precheck.done():
            return False
        if self._precheck.exception() is not None:
            return True  # refused: nothing to drain for
        busy = self.scheduler is not None and self.scheduler.has_work
        return not busy or time.monotonic() >= self._drain_deadline

    def idle_left(self) -> float | None:
        """Seconds until an idle unload is due (0: due now), or None when none will be."""
        if self.state is not S.SERVING or (self.scheduler is not None and self.scheduler.has_work):
            return None
        if self._unload_wanted:
            return 0.0
        if self.idle_unload <= 0:
            return None
        return max(0.0, self.idle_unload - (time.monotonic() - self._last_active))

    def unload_due(self) -> bool:
        return self.idle_left() == 0

    def touch(self) -> None:
        """The model was used now: the idle clock starts over."""
        self._last_active = time.monotonic()

    def status(self) -> EngineStatus:
        """The reply to ``engine.status``. Read-only: asking never counts as using the model."""
        sched, plan = self.scheduler, getattr(self.backend, "plan", None)
        return EngineStatus(
            status=self.state,
            model=self.served_id,
            error=self.error,
            backend=self.backend.name if self.backend is not None else self.cfg.backend,
            max_context=self.max_context,
            path=str(self.artifact_path),
            switching=self.switching,
            last_switch=self.last_switch,
            recent_switches=list(self.recent_switches),
            switch_outcomes=self.switch_outcomes,
            load_progress=self.load_progress,
            idle_unload=self.idle_unload,
            idle_seconds=round(time.monotonic() - self._last_active, 3),
            stats=sched.make_stats() if sched is not None else None,
            lanes=lanes_snapshot(sched, sched.clock()) if sched is not None else None,
            plan=asdict(plan) if plan is not None else dict(EMPTY_PLAN),
            telemetry=TELEMETRY.snapshot(),
            backend_stats=self.backend.stats() if self.backend is not None else {},
        )

    # -- messages taken at once (on the receive loop) ----------------------------------

    def configure(self, values: dict) -> None:
        """Live settings: LIVE_FIELDS, idle_unload, drain_timeout (no reload)."""
        for key in LIVE_FIELDS:
            if key in values:
                setattr(self.cfg, key, values[key])  # the scheduler reads the same object
        if "idle_unload" in values:
            self.idle_unload = float(values["idle_unload"])
            self._last_active = time.monotonic()
        if "drain_timeout" in values:
            self.drain_timeout = float(values["drain_timeout"])
        log.info("ignis.engine.configured", extra={"values": values})

    def request_unload(self) -> None:
        """Unload as an idle unload would, once nothing runs."""
        self._unload_wanted = True

    # -- transitions -------------------------------------------------------------------

    def _enter(self, state: EngineState) -> None:
        """Where a load or teardown ends. Under a switch accepted meanwhile the state stays
        SWITCHING and ``state`` becomes the one the switch resumes from."""
        if self.state is S.SWITCHING:
            self._resume = state
        else:
            self.state = state

    async def start(self) -> bool:
        """LOADING → SERVING, or FAILED with the reason in ``error``."""
        self._enter(S.LOADING)
        ok = await self._load()
        self._enter(S.SERVING if ok else S.FAILED)
        return ok

    async def reload(self) -> bool:
        """UNLOADED or FAILED → LOADING → SERVING | FAILED: the first request after an
        unload (or a failed load) loads the model; the requests queued behind it wait."""
        t0 = time.monotonic()
        if not await self.start():
            return False
        log.info("ignis.model.reloaded", extra={"model": self.served_id, "seconds": round(time.monotonic() - t0, 2)})
        return True

    async def unload(self) -> None:
        """SERVING → UNLOADED: idle for ``idle_unload`` seconds, or asked to."""
        idle = round(time.monotonic() - self._last_active, 1)
        self._unload_wanted = False
        await self._on_thread(self._teardown)
        self._enter(S.UNLOADED)
        log.info("ignis.model.unloaded", extra={"model": self.served_id, "idle_seconds": idle})

    async def accept_switch(self, sw: SwitchModel) -> None:
        """Any state → SWITCHING, and the precheck starts off the loop. Taken on the receive
        loop, so a second switch is refused at once (409 switch_in_progress)."""
        if self.state is S.SWITCHING:
            if sw.reply_channel:
                await self._send(sw.reply_channel, SwitchAck(sw.switch_id, False, "A switch is running.").to_message())
            return
        if self._serves_already(sw):
            log.info("ignis.model.switch_unchanged", extra={"switch_id": sw.switch_id, "model": self.served_id})
            if sw.reply_channel:
                ack = SwitchAck(sw.switch_id, True, f"'{self.served_id}' serves already.", unchanged=True)
                await self._send(sw.reply_channel, ack.to_message())
            return
        self._resume, self.state = self.state, S.SWITCHING
        self._pending = sw
        self.switching = {"from": self.served_id, "to": sw.served_id}
        self._drain_deadline = time.monotonic() + self.drain_timeout
        cfg = self._config_for(sw)
        self._precheck = asyncio.create_task(
            asyncio.to_thread(
                switch_precheck,
                sw,
                ram_budget=sw.config.get("ram_budget", self.ram_budget),
                kv_ram_budget=cfg.kv_ram_budget,
                max_context=sw.config.get("max_context", self.requested_max_context),
                block_size=cfg.block_size,
                backend=cfg.backend,
                freed_bytes=getattr(getattr(self.backend, "plan", None), "budget_bytes", 0),
            )
        )
        self._precheck.add_done_callback(lambda _t: self._wake())
        log.info(
            "ignis.model.switch_started",
            extra={"switch_id": sw.switch_id, "from": self.served_id, "to": sw.served_id, "trigger": sw.trigger},
        )
        if sw.reply_channel:
            await self._send(sw.reply_channel, SwitchAck(sw.switch_id, True).to_message())

    def _serves_already(self, sw: SwitchModel) -> bool:
        """``sw`` names what serves now: the same id and artifact, loaded with the same
        configuration. Such a switch is a no-op: no reload, the cache and its statistics
        stay, and it is no switch in the history."""
        if self.state is not S.SERVING or sw.refuse or sw.served_id != self.served_id:
            return False
        if Path(sw.path).resolve() != self.artifact_path.resolve():
            return False
        same_plan = sw.config.get("max_context", self.requested_max_context) == self.requested_max_context
        same_plan = same_plan and sw.config.get("ram_budget", self.ram_budget) == self.ram_budget
        loaded = dataclasses.replace(self.cfg, max_context=self.requested_max_context)
        return same_plan and dataclasses.replace(self._config_for(sw), max_context=self.requested_max_context) == loaded

    async def run_switch(self) -> None:
        """SWITCHING → refused (the state it left), switched, restored or failed; once
        ``switch_ready()``. The new model loads only after the old one is torn down."""
        sw, t0 = self._pending, time.monotonic()
        exc = self._precheck.exception()
        if exc is not None:
            reason = str(exc) if isinstance(exc, SwitchRefused) else f"{type(exc).__name__}: {exc}"
            return await self._end_switch(sw, REFUSED, reason, t0)
        if self.scheduler is not None and self.scheduler.seqs:  # the drain timed out
            await self._end_requests(list(self.scheduler.seqs), "The server switched models while this request ran.")
        old = (self.served_id, self.artifact_path, self.cfg, self.requested_max_context, self.ram_budget)
        await self._on_thread(self._teardown)
        self.served_id, self.artifact_path, self.cfg = sw.served_id, Path(sw.path), self._config_for(sw)
        self.requested_max_context = sw.config.get("max_context", self.requested_max_context)
        self.ram_budget = sw.config.get("ram_budget", self.ram_budget)
        if await self._load():
            return await self._end_switch(sw, SWITCHED, "", t0)
        reason = self.error
        if self._resume is not S.SERVING:
            return await self._end_switch(sw, FAILED, reason, t0)
        self.served_id, self.artifact_path, self.cfg, self.requested_max_context, self.ram_budget = old
        if await self._load():
            return await self._end_switch(sw, RESTORED, reason, t0)
        return await self._end_switch(sw, FAILED, f"{reason}; restoring {old[0]} failed too: {self.error}", t0)

    async def _end_switch(self, sw: SwitchModel, outcome: str, reason: str, t0: float) -> None:
        seconds = round(time.monotonic() - t0, 3)
        self.last_switch = {
            "outcome": outcome,
            "reason": reason,
            "from": self.switching["from"],
            "to": sw.served_id,
            "trigger": sw.trigger,
            "seconds": seconds,
            "at": time.time(),
        }
        # Every front end reads these from the status: whichever reads one first records it.
        self.recent_switches.append({"switch_id": sw.switch_id, **self.last_switch})
        self._pending = self._precheck = self.switching = None
        self._last_active = time.monotonic()
        self.switch_outcomes[outcome] = self.switch_outcomes.get(outcome, 0) + 1
        self.state = {SWITCHED: S.SERVING, RESTORED: S.SERVING, FAILED: S.FAILED}.get(outcome, self._resume)
        log.info("ignis.model.switch", extra={"switch_id": sw.switch_id, **self.last_switch})
        self._changed()  # the history changed, whatever the state did
        if self._announce is not None:  # front ends hear the new state before the requester hears the end
            await self._announce()
        if sw.reply_channel:
            done = SwitchDone(sw.switch_id, outcome, reason, self.served_id, seconds, str(self.artifact_path))
            await self._send(sw.reply_channel, done.to_message())

    # -- the work, on the step thread ------------------------------------------------

    def _config_for(self, sw: SwitchModel) -> EngineConfig:
        return dataclasses.replace(self.cfg, **{k: v for k, v in sw.config.items() if hasattr(self.cfg, k)})

    async def _on_thread(self, fn: Callable[[], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def _load(self) -> bool:
        """Load ``served_id`` from ``artifact_path``; on failure ``error`` says why and
        whatever the load took is released. Sets no state: the caller's transition does."""
        self.error = None
        try:
            await self._on_thread(self._load_on_thread)
        except Exception as exc:  # a bad artifact must not take the process down
            log.exception("ignis.model.load_failed", extra={"model": self.served_id, "path": str(self.artifact_path)})
            await self._on_thread(self._teardown)
            self.error, self.load_progress = f"{type(exc).__name__}: {exc}", None
            return False
        self._last_active = time.monotonic()
        return True

    def _progress(self, done: int, total: int) -> None:
        self.load_progress = {"done": done, "total": total, "unit": "tensors"}
        if self.on_progress:
            self.on_progress(self.served_id, done, total)

    def _load_on_thread(self) -> None:
        self.load_progress = {"done": 0, "total": 0, "unit": "tensors"}
        self.backend, self.scheduler = load_model(
            self.cfg,
            self.artifact_path,
            served_id=self.served_id,
            max_context=self.requested_max_context,
            ram_budget=self.ram_budget,
            progress=self._progress,
            on_context=lambda n: setattr(self, "max_context", n),
            loader=self._loader,
            backend_factory=self._backend_factory,
        )
        self.load_progress = None

    def _teardown(self) -> None:
        """Everything the load held is released."""
        if self.backend is not None:
            self.backend.unload()
        draft = getattr(self.scheduler, "draft_model", None)
        if draft is not None:  # spec.draft_model's backend goes with the target's
            draft.backend.unload()
        self.backend = self.scheduler = None
        gc_pause.after_unload()
