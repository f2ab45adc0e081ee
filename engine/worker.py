"""The engine loop, hosted on an asyncio event loop.

Embedded, this task runs on Daphne's loop with the in-memory Channels layer;
``manage.py runengine`` runs the very same task under its own loop against
``channels_redis``. Its shape is nano-vllm's: take messages, ``schedule()``
a plan, ``backend.step(plan)`` on one dedicated thread (so numpy or CUDA work
leaves the event loop free), ``update_from_output()`` into events, send them.

One model at a time. Between steps the loop also runs the model's lifecycle:
a switch (``engine.switch``: drain, check, tear down, load, restore on
failure), an idle unload after ``idle_unload`` seconds with nothing in use,
and the reload the next request triggers. ``status`` is serving | switching |
loading | unloaded | failed, as GET /v1/models shows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from engine.config import EngineConfig
from engine.lifecycle import ModelLifecycle
from engine.memory import MemoryPlan
from engine.messages import (
    ENGINE_CHANNEL,
    AbortRequest,
    AddRequest,
    ConfigureEngine,
    RequestFailed,
    SwitchModel,
    UnloadModel,
)
from engine.switching import ram_plan
from engine.telemetry import TELEMETRY, lanes_snapshot

log = logging.getLogger("ignis.engine")


class EngineWorker(ModelLifecycle):
    def __init__(
        self,
        layer,
        cfg: EngineConfig,
        artifact_path: Path,
        served_id: str,
        *,
        idle_unload: float = 0,
        drain_timeout: float = 30.0,
        ram_budget: int = 0,
        on_progress: Callable[[str, int, int], None] | None = None,
    ):
        self.layer = layer
        self.cfg = cfg
        self.artifact_path = Path(artifact_path)
        self.served_id = served_id
        self.state = "loading"  # serving | loading | unloaded | failed; "switching" while a switch is pending
        self.error: str | None = None
        self.backend = None
        self.scheduler = None
        self._inbox: deque[dict] = deque()
        self._wakeup = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ignis-step")
        self._max_context = cfg.max_context
        self._requested_max_context = cfg.max_context  # a load clamps cfg.max_context to the model's own
        self.idle_unload = float(idle_unload)
        self.drain_timeout = float(drain_timeout)
        self.ram_budget = int(ram_budget)
        self.on_progress = on_progress
        self.load_progress: dict | None = None
        self.switching: dict | None = None  # {from, to} while a switch runs
        self.last_switch: dict | None = None
        self.recent_switches: deque[dict] = deque(maxlen=32)  # finished switches, with their switch_id
        self.switch_outcomes: dict[str, int] = {}  # switched | refused | restored | failed -> count
        self._pending: SwitchModel | None = None
        self._precheck: asyncio.Task | None = None
        self._drain_deadline = 0.0
        self._last_active = time.monotonic()
        self._unload_wanted = False

    @property
    def status(self) -> str:
        return "switching" if self._pending is not None else self.state

    # -- loading ---------------------------------------------------------------

    def _progress(self, done: int, total: int) -> None:
        self.load_progress = {"done": done, "total": total, "unit": "tensors"}
        if self.on_progress:
            self.on_progress(self.served_id, done, total)

    def _load(self) -> None:
        """Runs on the step thread: weights in, plan made, scheduler built."""
        from engine.backends import create_backend
        from engine.kv_manager import KVManager
        from engine.loaders import load_artifact
        from engine.scheduler import Scheduler

        t0 = time.perf_counter()
        self.load_progress = {"done": 0, "total": 0, "unit": "tensors"}
        model_cfg, weights = load_artifact(self.artifact_path, self._progress)
        self._max_context = min(self._requested_max_context, model_cfg.max_position)
        self.cfg.max_context = self._max_context
        kv_budget = None
        if self.cfg.backend == "numpy":
            # Weights, then working memory; the KV pool takes the rest of the RAM budget.
            kv_budget = ram_plan(
                model_cfg,
                ram_budget=self.ram_budget,
                kv_ram_budget=self.cfg.kv_ram_budget,
                max_context=self._max_context,
                block_size=self.cfg.block_size,
                freed_bytes=0,
            ).kv_bytes
        backend = create_backend(self.cfg.backend)
        plan = backend.load(
            model_cfg,
            weights,
            block_size=self.cfg.block_size,
            kv_budget_bytes=kv_budget,
            host_kv_budget_bytes=self.cfg.host_kv_budget,
            max_context=self._max_context,
        )
        del weights
        self.backend = backend
        self.scheduler = Scheduler(self.cfg, KVManager(plan.num_blocks, plan.block_size, plan.num_host_blocks))
        from engine.constraint import ConstraintFactory

        self.scheduler.constraints = ConstraintFactory(self.artifact_path)
        self.scheduler.supports_prompt_logprobs = backend.supports_prompt_logprobs
        self.scheduler.constraints.warm_in_background()
        self.load_progress = None
        log.info(
            "ignis.runtime.vram_plan", extra={"model": self.served_id, "backend": self.cfg.backend, **asdict(plan)}
        )
        log.info(
            "ignis.model.loaded",
            extra={
                "model": self.served_id,
                "seconds": round(time.perf_counter() - t0, 2),
                "path": str(self.artifact_path),
            },
        )

    def _teardown(self) -> None:
        """Runs on the step thread: everything the load held is released."""
        if self.backend is not None:
            self.backend.unload()
        self.backend = self.scheduler = None
        import gc

        gc.collect()

    async def _load_current(self) -> bool:
        """Load ``served_id`` from ``artifact_path``; on failure status is failed with the reason."""
        self.state, self.error = "loading", None
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._load)
        except Exception as exc:  # a bad artifact must not take the process down
            log.exception("ignis.model.load_failed", extra={"model": self.served_id, "path": str(self.artifact_path)})
            await asyncio.get_running_loop().run_in_executor(self._thread, self._teardown)
            self.state, self.error, self.load_progress = "failed", f"{type(exc).__name__}: {exc}", None
            return False
        self.state = "serving"
        self._last_active = time.monotonic()
        return True

    # -- messages --------------------------------------------------------------

    async def _receive_loop(self) -> None:
        """Never cancelled mid-receive: a cancelled channels_redis receive can drop a message."""
        while True:
            msg = await self.layer.receive(ENGINE_CHANNEL)
            kind = msg.get("type")
            if kind == "engine.status":
                await self.layer.send(msg["reply_channel"], self.status_message())
                continue
            if kind == SwitchModel.TYPE:
                await self._accept_switch(SwitchModel.from_message(msg))
            elif kind == ConfigureEngine.TYPE:
                self._configure(ConfigureEngine.from_message(msg).values)
                if msg.get("reply_channel"):
                    await self.layer.send(msg["reply_channel"], {"type": "engine.configured"})
            elif kind == UnloadModel.TYPE:
                self._unload_wanted = True
            else:
                self._inbox.append(msg)
            self._wakeup.set()

    def status_message(self) -> dict:
        """The reply to ``engine.status``: state, scheduler stats, lanes, the memory
        plan (all zeros while nothing is loaded) and telemetry. Read-only: asking
        never counts as using the model."""
        msg = {
            "type": "engine.status",
            "status": self.status,
            "model": self.served_id,
            "error": self.error,
            "backend": self.cfg.backend,
            "max_context": self._max_context,
            "path": str(self.artifact_path),
            "switching": self.switching,
            "last_switch": self.last_switch,
            "recent_switches": list(self.recent_switches),
            "switch_outcomes": self.switch_outcomes,
            "load_progress": self.load_progress,
            "idle_unload": self.idle_unload,
            "idle_seconds": round(time.monotonic() - self._last_active, 3),
        }
        if self.scheduler is not None:
            msg["stats"] = self.scheduler.stats()
            msg["lanes"] = lanes_snapshot(self.scheduler, self.scheduler.clock())
        plan = getattr(self.backend, "plan", None)
        msg["plan"] = asdict(plan) if plan is not None else dict.fromkeys(MemoryPlan.__dataclass_fields__, 0)
        msg["telemetry"] = TELEMETRY.snapshot()
        return msg

    async def _send_all(self, outgoing: list[tuple[str, dict]]) -> None:
        for channel, msg in outgoing:
            await self.layer.send(channel, msg)
            if msg["type"] == "engine.tokens" and msg.get("ttft") is not None:
                log.info(
                    "ignis.request.ttft",
                    extra={
                        "request_id": msg["request_id"],
                        "ttft": round(msg["ttft"], 4),
                        "cached_tokens": msg.get("cached_tokens", 0),
                    },
                )
            if msg["type"] == "engine.finished":
                log.info(
                    "ignis.request.done",
                    extra={
                        **{
                            k: msg.get(k)
                            for k in (
                                "request_id",
                                "finish_reason",
                                "prompt_tokens",
                                "completion_tokens",
                                "cached_tokens",
                            )
                        },
                        **TELEMETRY.timings(msg["request_id"]),
                    },
                )

    async def _refuse(self, add: AddRequest, message: str, code: str, retry_after: float | None = None) -> None:
        await self.layer.send(
            add.reply_channel,
            RequestFailed(request_id=add.request_id, message=message, code=code, retry_after=retry_after).to_message(),
        )

    async def _take_messages(self) -> None:
        while self._inbox:
            msg = self._inbox.popleft()
            kind = msg.get("type")
            if kind == AddRequest.TYPE:
                add = AddRequest.from_message(msg)
                if self._pending is not None:
                    await self._refuse(add, "The server is switching models; retry shortly.", "model_switching", 5)
                    continue
                if self.state in ("unloaded", "failed"):
                    self._inbox.appendleft(msg)  # the next request loads the model; it waits for that load
                    return
                if self.state != "serving":
                    await self._refuse(add, f"The model failed to load: {self.error}", "model_load_failed")
                    continue
                if add.model and add.model.split("@")[0] != self.served_id:
                    await self._refuse(
                        add,
                        f"The model changed to '{self.served_id}' while this request was prepared; retry it.",
                        "model_switching",
                        5,
                    )
                    continue
                self._last_active = time.monotonic()
                refused = self.scheduler.add_request(add)
                if refused is not None:
                    await self.layer.send(add.reply_channel, refused.to_message())
                else:
                    log.info(
                        "ignis.request.admitted",
                        extra={
                            "request_id": add.request_id,
                            "class": add.request_class,
                            "prompt_tokens": len(add.prompt_token_ids),
                            "max_tokens": add.max_tokens,
                        },
                    )
            elif kind == AbortRequest.TYPE and self.scheduler is not None:
                await self._send_all(self.scheduler.abort_request(AbortRequest.from_message(msg).request_id))

    # -- the loop --------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        receiver = asyncio.create_task(self._receive_loop())
        try:
            await self._load_current()
            while True:
                await self._take_messages()
                if self._pending is not None and self._switch_ready():
                    await self._run_switch()
                    continue
                if (
                    self._pending is None
                    and self.state in ("unloaded", "failed")
                    and any(m.get("type") == AddRequest.TYPE for m in self._inbox)
                ):
                    await self._reload()
                    continue
                sched = self.scheduler
                if sched is None or not sched.has_work:
                    idle_left = self._idle_left()
                    if idle_left == 0:
                        await self._unload()
                        continue
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), idle_left)
                    except TimeoutError:
                        pass
                    continue
                plan = sched.schedule()
                if plan.is_empty:
                    self._wakeup.clear()
                    delay = sched.seconds_until_ready() or 0.001
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), delay)
                    except TimeoutError:
                        pass
                    continue
                try:
                    out = await loop.run_in_executor(self._thread, self.backend.step, plan)
                except Exception:
                    log.exception("ignis.engine.step_failed")
                    await self._fail_plan(plan)
                    continue
                await self._send_all(sched.update_from_output(plan, out))
                self._last_active = time.monotonic()
                self._log_interval()
        finally:
            receiver.cancel()
            self._thread.shutdown(wait=False)

    async def _fail_plan(self, plan) -> None:
        """A step that raised ends the sequences it carried with engine_error; the rest go on."""
        seq_ids = [lane.seq_id for lane in plan.decode] + ([plan.prefill.seq_id] if plan.prefill else [])
        for seq_id in seq_ids:
            seq = self.scheduler.sequence(seq_id)
            if seq is not None:
                await self._fail_sequence(seq, "The engine failed while running this request.")

    async def _fail_sequence(self, seq, message: str) -> None:
        """End a live sequence with ``engine_error``: its lane and pages free, its client told why."""
        self.scheduler.abort_request(seq.request_id)
        await self.layer.send(
            seq.reply_channel,
            RequestFailed(request_id=seq.request_id, message=message, code="engine_error", status=500).to_message(),
        )

    def _log_interval(self, every: float = 5.0) -> None:
        """DEBUG ``ignis.scheduler.interval``: the scheduler's counters, at most every ``every`` s of work."""
        now = time.monotonic()
        if now - getattr(self, "_interval_at", 0.0) < every or not log.isEnabledFor(logging.DEBUG):
            return
        self._interval_at = now
        stats = self.scheduler.stats()
        kv = stats.pop("kv_pages", {})
        log.debug("ignis.scheduler.interval", extra={**stats, **{f"kv_{k}": v for k, v in kv.items()}})
