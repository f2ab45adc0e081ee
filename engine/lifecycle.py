"""The model's lifecycle inside the engine loop: live configuration, switches,
idle unload and the reload after it.

A mixin of ``EngineWorker`` (engine/worker.py): it runs on the worker's event
loop between steps and uses the worker's state (``scheduler``, ``backend``,
``_thread``, ``_inbox``, ``layer``). Kept apart so the loop itself reads in
one screen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from engine.messages import FAILED, REFUSED, RESTORED, SWITCHED, AddRequest, SwitchAck, SwitchDone, SwitchModel
from engine.switching import LIVE_FIELDS, SwitchRefused, switch_precheck

log = logging.getLogger("ignis.engine")


class ModelLifecycle:
    def _configure(self, values: dict) -> None:
        for key in LIVE_FIELDS:
            if key in values:
                setattr(self.cfg, key, values[key])
        if "idle_unload" in values:
            self.idle_unload = float(values["idle_unload"])
            self._last_active = time.monotonic()
        if "drain_timeout" in values:
            self.drain_timeout = float(values["drain_timeout"])
        log.info("ignis.engine.configured", extra={"values": values})

    # -- switches ----------------------------------------------------------------

    async def _accept_switch(self, sw: SwitchModel) -> None:
        """Runs on the receive loop, so a second switch is refused at once (409 switch_in_progress)."""
        if self._pending is not None:
            if sw.reply_channel:
                await self.layer.send(
                    sw.reply_channel, SwitchAck(sw.switch_id, False, "A switch is running.").to_message()
                )
            return
        self._pending = sw
        self.switching = {"from": self.served_id, "to": sw.served_id}
        self._drain_deadline = time.monotonic() + self.drain_timeout
        freed = getattr(getattr(self.backend, "plan", None), "budget_bytes", 0)
        cfg = dataclasses.replace(self.cfg, **{k: v for k, v in sw.config.items() if hasattr(self.cfg, k)})
        max_context = sw.config.get("max_context", self._requested_max_context)
        ram_budget = sw.config.get("ram_budget", self.ram_budget)
        self._precheck = asyncio.create_task(
            asyncio.to_thread(
                switch_precheck,
                sw,
                ram_budget=ram_budget,
                kv_ram_budget=cfg.kv_ram_budget,
                max_context=max_context,
                block_size=cfg.block_size,
                backend=cfg.backend,
                freed_bytes=freed,
            )
        )
        self._precheck.add_done_callback(lambda _t: self._wakeup.set())
        log.info(
            "ignis.model.switch_started",
            extra={"switch_id": sw.switch_id, "from": self.served_id, "to": sw.served_id, "trigger": sw.trigger},
        )
        if sw.reply_channel:
            await self.layer.send(sw.reply_channel, SwitchAck(sw.switch_id, True).to_message())

    def _switch_ready(self) -> bool:
        """The precheck is done, and so is the drain (nothing running, or its timeout passed)."""
        if self._precheck is None or not self._precheck.done():
            return False
        if self._precheck.exception() is not None:
            return True  # refused: nothing to drain for
        busy = self.scheduler is not None and self.scheduler.has_work
        return not busy or time.monotonic() >= self._drain_deadline

    async def _run_switch(self) -> None:
        sw, t0 = self._pending, time.monotonic()
        old = (self.served_id, self.artifact_path, self.cfg, self._requested_max_context, self.ram_budget, self.state)
        exc = self._precheck.exception()
        if exc is not None:
            reason = str(exc) if isinstance(exc, SwitchRefused) else f"{type(exc).__name__}: {exc}"
            return await self._end_switch(sw, REFUSED, reason, t0)
        if self.scheduler is not None:  # the drain timed out: what still runs ends with engine_error
            for seq in list(self.scheduler.seqs.values()):
                await self._fail_sequence(seq, "The server switched models while this request ran.")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._teardown)
        self.served_id, self.artifact_path = sw.served_id, Path(sw.path)
        self.cfg = dataclasses.replace(self.cfg, **{k: v for k, v in sw.config.items() if hasattr(self.cfg, k)})
        self._requested_max_context = sw.config.get("max_context", self._requested_max_context)
        self.ram_budget = sw.config.get("ram_budget", self.ram_budget)
        if await self._load_current():
            return await self._end_switch(sw, SWITCHED, "", t0)
        reason = self.error
        if old[5] != "serving":
            return await self._end_switch(sw, FAILED, reason, t0)
        self.served_id, self.artifact_path, self.cfg, self._requested_max_context, self.ram_budget = old[:5]
        if await self._load_current():
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
        log.info("ignis.model.switch", extra={"switch_id": sw.switch_id, **self.last_switch})
        if sw.reply_channel:
            await self.layer.send(
                sw.reply_channel, SwitchDone(sw.switch_id, outcome, reason, self.served_id, seconds).to_message()
            )

    # -- idle unload and the reload after it -------------------------------------------

    def _idle_left(self) -> float | None:
        """Seconds until an idle unload is due (0: due now), or None when none will be."""
        if self.state != "serving" or self._pending is not None:
            return None
        if self.scheduler is not None and self.scheduler.has_work:
            return None
        if self._unload_wanted:
            return 0.0
        if self.idle_unload <= 0:
            return None
        return max(0.0, self.idle_unload - (time.monotonic() - self._last_active))

    async def _unload(self) -> None:
        idle = round(time.monotonic() - self._last_active, 1)
        self._unload_wanted = False
        await asyncio.get_running_loop().run_in_executor(self._thread, self._teardown)
        self.state = "unloaded"
        log.info("ignis.model.unloaded", extra={"model": self.served_id, "idle_seconds": idle})

    async def _reload(self) -> None:
        """The first request after an unload (or a failed load) loads the model; the ones queued wait for it."""
        t0 = time.monotonic()
        if await self._load_current():
            log.info(
                "ignis.model.reloaded", extra={"model": self.served_id, "seconds": round(time.monotonic() - t0, 2)}
            )
            return
        waiting = list(self._inbox)
        self._inbox.clear()
        for msg in waiting:  # those that waited for this load are refused; the next request tries again
            if msg.get("type") == AddRequest.TYPE:
                await self._refuse(
                    AddRequest.from_message(msg), f"The model failed to load: {self.error}", "model_load_failed"
                )
            else:
                self._inbox.append(msg)
