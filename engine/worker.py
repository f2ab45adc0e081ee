"""The engine loop, hosted on an asyncio event loop.

Embedded, this task runs on a thread and loop of its own beside Daphne's (``serve``'s
EngineThread), with an in-process Channels layer that bridges the two loops;
``manage.py runengine`` runs the very same task under its own loop against
``channels_redis``. Its shape is nano-vllm's: take messages, ``schedule()``
a plan, ``backend.step(plan)`` on one dedicated thread (so numpy or CUDA work
leaves the event loop free), ``update_from_output()`` into per-request
outputs, send them. Plain decode rounds are planned ahead (``_run_rounds``,
engine/run_ahead.py): round N+1 is queued on the step thread while N computes, and
N's output is turned into events while N+1 computes.

The worker is the engine's edge: it alone knows each request's reply channel
and turns typed outputs into wire dicts. The model's life (load, switch, idle
unload, reload) is the ModelHost's (engine/host.py); between steps the loop
runs whichever of its transitions is due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from engine import run_ahead
from engine.admission import compile_grammar
from engine.backend import StepOutput, StepPlan
from engine.config import EngineConfig
from engine.host import ModelHost
from engine.loading import BackendFactory, Loader
from engine.messages import (
    STATUS_GROUP,
    AbortRequest,
    AddRequest,
    ConfigureEngine,
    EngineConfigured,
    EngineHeartbeat,
    RequestFailed,
    RequestFinished,
    StatusRequest,
    SwitchModel,
    TokenEvent,
    UnloadModel,
    worker_channel,
)
from engine.outputs import EngineOutput
from engine.refusals import refusal
from engine.sequence import SequenceStatus
from engine.telemetry import TELEMETRY

log = logging.getLogger("ignis.engine")


class EngineWorker:
    """The loop for one model host. ``layer`` is a Channels layer; the rest is the
    ModelHost's (engine/host.py): ``loader`` and ``backend_factory`` default to
    engine.loaders.load_artifact and engine.backends.create_backend."""

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
        heartbeat: float = 1.0,
        on_progress: Callable[[str, int, int], None] | None = None,
        loader: Loader | None = None,
        backend_factory: BackendFactory | None = None,
        worker_id: str | None = None,
        beats_before_first_tokens: bool | None = None,
    ):
        self.layer = layer
        self.heartbeat = float(heartbeat)
        self.engine_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # A fleet's worker (docs/FLEET.md) takes its messages from its own channel; without an id
        # (embedded, or a lone runengine) from ENGINE_CHANNEL, as before.
        self.worker_id = worker_id or ""
        self.channel = worker_channel(worker_id)
        # A worker in its own process (runengine: a fleet's, or a lone one) announces a request running
        # before its first token goes out, so its last beat never lists a streaming request as waiting
        # (front ends would end it engine_unavailable, or send it again). Embedded, the engine dies
        # with its front end: the beat soon after the token does.
        self.beats_before_first_tokens = (
            bool(worker_id) if beats_before_first_tokens is None else beats_before_first_tokens
        )
        self.hostname = socket.gethostname()
        self.draining = False  # drain(): nothing new is admitted
        self.leaving = False
        self._changed = asyncio.Event()
        self._inbox: deque[dict] = deque()
        self._wakeup = asyncio.Event()
        # request_id -> reply channel: every request this worker owes an answer, from the moment its
        # AddRequest is taken off the channel until its last message (engine.finished or engine.failed)
        # has been handed to the layer (the send awaited). A drain waits for this to empty.
        self._replies: dict[str, str] = {}
        self._began: set[str] = set()  # of those, the ones a token event was sent for (they stream)
        self._settled = asyncio.Event()  # set whenever a request stops being owed
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ignis-step")
        self._interval_at = 0.0
        self.host = ModelHost(
            cfg,
            artifact_path,
            served_id,
            step_thread=self._thread,
            send=self._send,
            end_requests=self._end_with_error,
            wake=self._wakeup.set,
            announce=self.announce,
            changed=self._changed.set,
            idle_unload=idle_unload,
            drain_timeout=drain_timeout,
            ram_budget=ram_budget,
            on_progress=on_progress,
            loader=loader,
            backend_factory=backend_factory,
        )

    # -- the loop --------------------------------------------------------------

    async def run(self) -> None:
        """Load, then serve until cancelled."""
        receiver = asyncio.create_task(self._receive_loop())
        publisher = asyncio.create_task(self._publish_loop())
        host = self.host
        try:
            await host.start()
            await self.announce()
            while True:
                await self._take_messages()
                if await self._tend_model():
                    continue
                sched = host.scheduler
                plan = sched.schedule() if sched is not None and sched.has_work else None
                if plan is None or plan.is_empty:
                    # Nothing to run until a message arrives, the idle unload falls due or the gate opens.
                    await self._wait(host.idle_left() if plan is None else sched.prefill_wait())
                    continue
                await self._run_rounds(sched, plan)
        finally:
            receiver.cancel()
            publisher.cancel()
            self._thread.shutdown(wait=False, cancel_futures=True)  # a round queued ahead never starts

    async def _run_rounds(self, sched, plan: StepPlan) -> None:
        """Run ``plan``, and while each round computes plan the next one ahead and hand it to the step
        thread behind it (engine/run_ahead.py), so it starts the moment the one before ends; then turn
        the finished round's output into events. Returns after a round nothing was planned ahead of
        (the loop then schedules as before: admissions, prefill, swaps, model transitions)."""
        loop = asyncio.get_running_loop()
        if plan.prefill is not None and plan.decode:
            # Its prefill's first tokens go out while its decode round runs, not a round later:
            # two steps queued back to back on the step thread (the card never waits between them).
            first, plan = split_prefill(plan)
            running = loop.run_in_executor(self._thread, self._run_step, first, True)
            rest = loop.run_in_executor(self._thread, self._run_step, plan, True)
            try:
                out = await running
            except Exception:
                log.exception("ignis.engine.step_failed")
                first, out = await self._isolate(first)
            await self._send_outputs(sched.update_from_output(first, out))
            self._log_round(first, out)
            running = rest
        else:
            running = loop.run_in_executor(self._thread, self._run_step, plan, True)
        planned_ahead = False  # whether ``plan`` was planned while the round before it ran
        while True:
            ahead = run_ahead.plan_ahead(sched, plan) if self._may_run_ahead() else None
            behind = loop.run_in_executor(self._thread, self._run_step, ahead, True) if ahead is not None else None
            try:
                out = await running
                if out.unfinished is not None:  # queued on the step thread behind ``behind``'s launches
                    out = await loop.run_in_executor(self._thread, self.host.backend.finish, out)
            except Exception:
                log.exception("ignis.engine.step_failed")
                if behind is not None:  # it fed what the failed round drew: its output is no one's
                    with contextlib.suppress(Exception):
                        await behind
                    behind = None
                plan, out = await self._isolate(run_ahead.fill_known(sched, plan))
            await self._send_outputs(sched.update_from_output(plan, out))
            self.host.touch()
            self._log_round(plan, out, planned_ahead)
            self._log_interval()
            if behind is None:
                return
            plan, running, planned_ahead = ahead, behind, True
            await self._take_messages()  # an abort ends its lane now; an admission waits for a planned round

    def _run_step(self, plan: StepPlan, defer: bool = False) -> StepOutput:
        """On the step thread: one step (``step_stage`` set here, so a step queued behind another
        never resets the stage of the one that runs). ``defer``: a backend that can may return the
        decode round queued (Backend.defers_rounds); the caller then runs ``finish`` on this thread."""
        backend = self.host.backend
        backend.step_stage = "plan"
        if defer and backend.defers_rounds:
            return backend.step(plan, defer=True)
        return backend.step(plan)

    def _may_run_ahead(self) -> bool:
        """Rounds may be planned ahead now: model.async_rounds, a backend that can, and nothing the
        synchronous loop must see first (a message queued, a switch or unload due)."""
        host = self.host
        if not host.cfg.async_rounds or not getattr(host.backend, "supports_async_rounds", False):
            return False
        return not self._inbox and not host.switch_ready() and not host.unload_due()

    async def _tend_model(self) -> bool:
        """Run the model transition that is due, if one is (True: one ran)."""
        host = self.host
        if host.switch_ready():
            await host.run_switch()
        elif host.needs_load and any(m.get("type") == AddRequest.TYPE for m in self._inbox):
            if not await host.reload():
                await self.announce()  # FAILED is known before a refusal says so
                await self._refuse_waiting()
        elif host.unload_due():
            await host.unload()
        else:
            return False
        await self.announce()  # before anything the transition lets through is answered
        return True

    async def _wait(self, timeout: float | None) -> None:
        """Until a message arrives (the receive loop sets the event) or ``timeout`` passes."""
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass

    # -- messages in -----------------------------------------------------------

    async def _receive_loop(self) -> None:
        """Never cancelled mid-receive: a cancelled channels_redis receive can drop a message."""
        while True:
            msg = await self.layer.receive(self.channel)
            kind = msg.get("type")
            if kind == StatusRequest.TYPE:
                await self._send(StatusRequest.from_message(msg).reply_channel, self.status_message())
                continue
            if kind == SwitchModel.TYPE:
                await self.host.accept_switch(SwitchModel.from_message(msg))
                await self.announce()
            elif kind == ConfigureEngine.TYPE:
                configure = ConfigureEngine.from_message(msg)
                self.host.configure(configure.values)
                if configure.reply_channel:
                    await self._send(configure.reply_channel, EngineConfigured().to_message())
            elif kind == UnloadModel.TYPE:
                self.host.request_unload()
            else:
                if kind == AddRequest.TYPE:  # owed an answer from now on, queued or not (a resend keeps the first)
                    self._replies.setdefault(msg["request_id"], msg["reply_channel"])
                self._inbox.append(msg)
            self._wakeup.set()

    def status_message(self) -> dict:
        """The reply to ``engine.status`` (EngineStatus on the wire)."""
        return self.host.status().to_message()

    # -- the status, pushed to every front end -------------------------------------------

    def heartbeat_message(self) -> dict:
        """EngineHeartbeat: the status, and which of this engine's requests a front end
        must end (and how) should this engine stop answering."""
        sched = self.host.scheduler
        seqs = sched.seqs if sched is not None else {}
        # Every request still owed an answer: queued, admitted, or its last message on its way.
        # Running: it may have streamed (a first token computed or sent); waiting: it cannot have.
        running, waiting = [], []
        for request_id in self._replies:
            seq = seqs.get(request_id)
            began = request_id in self._began or (seq is not None and seq.first_token_time is not None)
            (running if began else waiting).append(request_id)
        status = self.status_message()
        stats = status.get("stats") or {}
        kv = stats.get("kv_pages") or {}
        beat = EngineHeartbeat(
            self.engine_id,
            self.heartbeat,
            status,
            running,
            waiting,
            worker_id=self.worker_id,
            channel=self.channel,
            host=self.hostname,
            model=status.get("model", ""),
            lanes_busy=int(stats.get("lanes_busy", 0)),
            lanes_total=int(stats.get("lanes_total", 0)),
            kv_pages_free=int(kv.get("free", 0)) + int(kv.get("retained", 0)) - int(kv.get("pinned", 0)),
            draining=self.draining,
            leaving=self.leaving,
        )
        return beat.to_message()

    async def announce(self) -> None:
        """Publish the status to STATUS_GROUP now."""
        self._changed.clear()
        try:
            await self.layer.group_send(STATUS_GROUP, self.heartbeat_message())
        except Exception:  # a layer hiccup must not stop the loop; the next beat retries
            log.exception("ignis.engine.heartbeat_failed")

    async def _publish_loop(self, min_gap: float = 0.1) -> None:
        """A heartbeat every ``heartbeat`` seconds, and one soon after every change (state,
        history, a request's first token), at most one per ``min_gap`` seconds."""
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), self.heartbeat)
            except TimeoutError:
                pass
            await self.announce()
            await asyncio.sleep(min(min_gap, self.heartbeat))

    async def _take_messages(self) -> None:
        """Admit or abort what arrived. While no model is loaded a request waits at the
        head of the inbox (and everything behind it): the loop reloads for it."""
        while self._inbox:
            kind = self._inbox[0].get("type")
            if kind == AddRequest.TYPE and self.host.needs_load and not self.draining:
                return
            msg = self._inbox.popleft()
            if kind == AddRequest.TYPE:
                await self._add(AddRequest.from_message(msg))
            elif kind == AbortRequest.TYPE and self.host.scheduler is not None:
                request_id = AbortRequest.from_message(msg).request_id
                await self._send_outputs(
                    self.host.scheduler.finish_requests(request_id, SequenceStatus.FINISHED_ABORTED)
                )

    async def _add(self, add: AddRequest) -> None:
        sched = self.host.scheduler
        if sched is not None and add.request_id in sched.seqs:
            # A front end that took this engine for gone (late heartbeats) sends what it thought queued
            # again: the request is served already, and its books must stay the original's.
            if self._replies.get(add.request_id) != add.reply_channel:
                await self._send(add.reply_channel, refusal("duplicate_request", add.request_id).to_message())
            return
        self._replies.setdefault(add.request_id, add.reply_channel)
        if self.draining:  # front ends stopped routing here at the draining beat; this one crossed it
            await self._last(add.request_id, _shutting_down(add.request_id).to_message())
            return
        refused = self.host.refusal_for(add)
        if refused is None:
            self.host.touch()
            compiled = None
            if add.grammar:  # compiling can take seconds: never on the event loop
                stops = sorted(set(add.stop_token_ids or ()))
                constraints = self.host.scheduler.constraints
                compiled = await asyncio.to_thread(compile_grammar, add.grammar, stops, constraints)
                if add.request_id not in self._replies:  # a drain ended it meanwhile
                    return
            refused = self.host.scheduler.add_request(add, compiled)
        if refused is not None:
            await self._last(add.request_id, refused.to_message())
            return
        log.info(
            "ignis.request.admitted",
            extra={
                "request_id": add.request_id,
                "class": add.request_class,
                "prompt_tokens": len(add.prompt_token_ids),
                "max_tokens": add.max_tokens,
            },
        )

    async def _refuse_waiting(self) -> None:
        """The load the waiting requests asked for failed: each is refused; the next request tries again."""
        waiting = list(self._inbox)
        self._inbox.clear()
        for msg in waiting:
            if msg.get("type") == AddRequest.TYPE:
                add = AddRequest.from_message(msg)
                self._replies.setdefault(add.request_id, add.reply_channel)
                await self._last(add.request_id, self.host.load_failed(add.request_id).to_message())
            else:
                self._inbox.append(msg)

    # -- drain (SIGTERM) ---------------------------------------------------------

    def busy_request_ids(self) -> list[str]:
        """Every request this worker still owes an answer (see ``_replies``)."""
        return list(self._replies)

    async def drain(self, timeout: float) -> int:
        """Admit nothing new, let what is owed an answer finish within ``timeout`` seconds, end the
        rest with engine_error, then say goodbye (a ``leaving`` heartbeat: front ends drop this
        worker at once). Returns how many requests had to be ended. The loop keeps stepping meanwhile.

        It returns only once every request this worker took has had its last message (engine.finished
        or engine.failed) handed to the layer: a request leaves the scheduler in the step that finishes
        it, before that message is sent, so the scheduler's books alone cannot tell."""
        self.draining = True
        log.info("ignis.engine.draining", extra={"worker_id": self.worker_id, "running": len(self._replies)})
        await self.announce()  # front ends route nothing more here from this beat on
        self._wakeup.set()  # requests already in the inbox are refused now, not after a wait
        deadline = time.monotonic() + max(timeout, 0.0)
        while self._replies and (left := deadline - time.monotonic()) > 0:
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), left)
        ended = list(self._replies)
        if ended:
            await self._end_owed(ended, "The engine worker shut down before this request finished.")
        self.leaving = True
        await self.announce()
        log.info("ignis.engine.drained", extra={"worker_id": self.worker_id, "ended": len(ended)})
        return len(ended)

    async def _end_owed(self, request_ids: list[str], message: str) -> None:
        """The drain's timeout passed: end what the scheduler holds, and what it does not (queued in
        the inbox, a grammar compiling, a last message still being sent) with engine_error too."""
        sched = self.host.scheduler
        held = [r for r in request_ids if sched is not None and r in sched.seqs]
        if held:
            await self._end_with_error(held, message)
        queued = set(request_ids) - set(held)
        self._inbox = deque(m for m in self._inbox if not _adds_one_of(m, queued))
        for request_id in queued:
            if request_id in self._replies:
                await self._last(request_id, refusal("engine_error", request_id, message).to_message())

    # -- outputs out -----------------------------------------------------------

    async def _send(self, channel: str, msg: dict) -> None:
        await self.layer.send(channel, msg)

    async def _last(self, request_id: str, msg: dict) -> None:
        """Send a request's last message (engine.finished or engine.failed); once the layer has taken
        it (the send awaited: with channels_redis, it is in Redis) the request is owed nothing more."""
        channel = self._replies.get(request_id)
        if channel is None:  # answered already: one request's books never stop the loop
            log.warning("ignis.engine.reply_unknown", extra={"request_id": request_id, "type": msg.get("type")})
            return
        await self._send(channel, msg)
        self._replies.pop(request_id, None)
        self._began.discard(request_id)
        self._settled.set()

    async def _send_outputs(self, outputs: list[EngineOutput]) -> None:
        """Address each output to its request's client, serialize it, log what the metrics read."""
        if self.beats_before_first_tokens and any(isinstance(o, TokenEvent) and o.ttft is not None for o in outputs):
            # Should a fleet's worker die, its front ends send a request its last beat listed as waiting
            # to another worker: from its first token on the beat must list it running, so the beat that
            # says so goes out before that token does (a client never sees its first tokens twice).
            await self.announce()
        for output in outputs:
            msg = output.to_message()
            if isinstance(output, RequestFinished):
                await self._last(output.request_id, msg)
            elif (channel := self._replies.get(output.request_id)) is not None:
                self._began.add(output.request_id)
                await self._send(channel, msg)
            else:  # answered already (see _last)
                log.warning("ignis.engine.reply_unknown", extra={"request_id": output.request_id, "type": msg["type"]})
                continue
            if msg["type"] == "engine.tokens" and msg.get("ttft") is not None:
                self._changed.set()  # it streams now: front ends end it with engine_error should this engine go
                log.info(
                    "ignis.request.ttft",
                    extra={
                        "request_id": msg["request_id"],
                        "ttft": round(msg["ttft"], 4),
                        "cached_tokens": msg.get("cached_tokens", 0),
                    },
                )
            if msg["type"] == "engine.finished":
                keys = ("request_id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")
                log.info(
                    "ignis.request.done",
                    extra={**{k: msg.get(k) for k in keys}, **TELEMETRY.timings(msg["request_id"])},
                )

    async def _step(self, plan: StepPlan) -> StepOutput:
        self.host.backend.step_stage = "plan"
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.host.backend.step, plan)

    async def _isolate(self, plan: StepPlan) -> tuple[StepPlan, StepOutput]:
        """A step raised: find the rows that raise and end only those with engine_error.

        Each prefill span (a group's one by one) and each decode lane run again alone; what the rows that ran
        computed comes back as one plan and output for ``update_from_output``. Running
        a row again is safe: it writes the same tokens into the same KV slots. The
        swaps ran once (the backend's ``step_stage`` says how far the step got): done
        before a row raised, run first here if the step raised before them, and if they
        raised, every row of the plan ends (its pages are not where the books say), and
        so does every lane they were moving out (its host copy is not there).
        """
        stage = getattr(self.host.backend, "step_stage", "plan")
        rows = [StepPlan(prefill=span) for span in plan.prefills]
        rows += [StepPlan(decode=[lane]) for lane in plan.decode]
        failed: list[StepPlan] = []
        ran, out = StepPlan(), StepOutput()
        spans: list[tuple] = []  # (span, its output) of the prefill spans that ran
        swaps_failed = stage == "swaps"
        if stage == "plan" and (plan.swap_out or plan.swap_in):
            try:
                await self._step(StepPlan(swap_out=plan.swap_out, swap_in=plan.swap_in))
            except Exception:
                swaps_failed = True
        if swaps_failed:
            failed, rows = rows, []
        for row in rows:
            try:
                got = await self._step(row)
            except Exception as exc:
                failed.append(row)
                log.warning("ignis.engine.row_failed", extra={"seq_id": _row_seq_id(row), "error": repr(exc)})
                continue
            if row.prefill is not None:
                spans.append((row.prefill, got))
            else:
                ran.decode += row.decode
                out.decode_tokens += got.decode_tokens
                out.decode_logprobs += got.decode_logprobs or [None] * len(got.decode_tokens)
                out.decode_seconds = max(out.decode_seconds, got.decode_seconds)
        if spans:
            (ran.prefill, first), *more = spans
            out.prefill_token, out.prefill_logprob = first.prefill_token, first.prefill_logprob
            out.prefill_logits, out.prompt_logprobs = first.prefill_logits, first.prompt_logprobs
            ran.prefill_more, out.prefill_more = [s for s, _ in more], [o for _, o in more]
            out.prefill_seconds = sum(o.prefill_seconds for _, o in spans)
        sched = self.host.scheduler
        seqs = [sched.sequence(_row_seq_id(row)) for row in failed]
        if swaps_failed:  # the lanes they were moving out end too: their host copy is not there
            moved = {h for _, h in plan.swap_out}
            seqs += [s for s in sched.preempted if moved & set(s.host_block_table)]
        await self._end_with_error(
            [s.request_id for s in seqs if s is not None], "The engine failed while running this request."
        )
        return ran, out

    async def _end_with_error(self, request_ids: list[str], message: str) -> None:
        """End live requests with ``engine_error``: their lanes and pages free, their clients told why."""
        for done in self.host.scheduler.finish_requests(request_ids, SequenceStatus.FINISHED_ABORTED):
            failed: RequestFailed = refusal("engine_error", done.request_id, message)
            await self._last(done.request_id, failed.to_message())

    def _log_round(self, plan: StepPlan, out: StepOutput, planned_ahead: bool = False) -> None:
        """DEBUG ``ignis.engine.round``: one line a step, what the backend took, and whether the step was
        planned while the one before ran (bench/bench_serving.py)."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "ignis.engine.round",
                extra={
                    "decode_seconds": round(out.decode_seconds, 6),
                    "prefill_seconds": round(out.prefill_seconds, 6),
                    **(
                        {"prefill_queued_seconds": round(out.prefill_queued_seconds, 6)}
                        if out.prefill_queued_seconds is not None
                        else {}
                    ),
                    "prefill_spans": len(plan.prefills),
                    "lanes": len(plan.decode),
                    "ahead": planned_ahead,
                },
            )

    def _log_interval(self, every: float = 5.0) -> None:
        """DEBUG ``ignis.scheduler.interval``: the scheduler's counters, at most every ``every`` s of work."""
        now = time.monotonic()
        if now - self._interval_at < every or not log.isEnabledFor(logging.DEBUG):
            return
        self._interval_at = now
        stats = asdict(self.host.scheduler.make_stats())
        kv = stats.pop("kv_pages", {})
        log.debug("ignis.scheduler.interval", extra={**stats, **{f"kv_{k}": v for k, v in kv.items()}})


def _adds_one_of(msg: dict, request_ids: set[str]) -> bool:
    return msg.get("type") == AddRequest.TYPE and msg.get("request_id") in request_ids


def _shutting_down(request_id: str) -> RequestFailed:
    """The answer to a request that reached a draining worker (it crossed the draining beat)."""
    return RequestFailed(
        request_id, "This engine worker is shutting down; retry shortly.", "engine_unavailable", retry_after=1
    )


def _row_seq_id(row: StepPlan) -> int:
    """The sequence of a one-row plan (``_isolate``'s)."""
    return row.prefill.seq_id if row.prefill is not None else row.decode[0].seq_id


def split_prefill(plan: StepPlan) -> tuple[StepPlan, StepPlan]:
    """``plan`` as two steps in its own order: its swaps and prefill spans, then its decode round
    (what the backend runs for ``plan`` in one step, so the tokens are the same)."""
    first = StepPlan(swap_out=plan.swap_out, swap_in=plan.swap_in, prefill=plan.prefill, prefill_more=plan.prefill_more)
    return first, StepPlan(decode=plan.decode, drafts=plan.drafts)
