"""The Responses API over a WebSocket at /v1/responses.

The client sends ``{"type": "response.create", ...}`` with the body of
POST /v1/responses (``stream`` is implicit); the events come back as on SSE,
one JSON text frame each, with the request's ``stream_id`` when it gave one.
``generate: false`` prefills the prompt and stores the response without
output, so a later ``previous_response_id`` resumes from warm state.

The consumer has the HTTP consumer's shape: each engine round is its own
message, so a socket going away aborts its sequence at once. One response
runs at a time per socket; further ``response.create`` events wait in order.
Errors are ``{"type": "error", "error": {...}}`` frames and never close the
socket; an event over ``server.body_limit`` is answered ``request_too_large``, as
HTTP answers 413 (Daphne closes a frame past twice that with 1009 and a reason:
ignis_site/daphne_ws.py). When every decode lane is busy the engine answers ``engine_full``;
here that is not refused but retried until a lane frees (the request is
queued). A socket with nothing in flight for ``server.socket_idle_close``
seconds is closed. Each response has the HTTP route's deadline (the request's
``deadline``, else ``server.deadline``), its clock started when it is handed
to the engine: past it, the sequence is aborted and the response ends
``incomplete`` with reason ``deadline`` and the output so far.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque

from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from apps.api.consumer import Timers
from apps.api.parsers import parse_json_body
from apps.api.responses.events import ResponseRun
from apps.api.responses.service import response_parse, response_prepare_async, stored_response_save
from apps.core import engine_client
from apps.core.errors import BodyTooLarge, IgnisError, InvalidRequest, error_from_engine, internal_error
from apps.models.switching import model_hold, switch_gate

log = logging.getLogger("ignis.api")
RETRY_MAX_WAIT = 0.5  # seconds between admission attempts while every lane is busy


class ResponsesSocketConsumer(Timers, AsyncWebsocketConsumer):
    async def dispatch(self, message: dict) -> None:
        engine_client.reply_heard(message)  # a request's last message: the fleet's table forgets it
        await super().dispatch(message)

    async def connect(self) -> None:
        self.pending: deque[dict] = deque()
        self.run: ResponseRun | None = None
        self.stream_id: str | None = None
        self.started = False
        self.last_active = time.monotonic()
        self.tasks: set[asyncio.Task] = set()
        await self.accept()
        idle = settings.IGNIS["server.socket_idle_close"]
        if idle:
            self._spawn(self._idle_watch(idle))

    async def disconnect(self, code: int) -> None:
        if self.run is not None:
            await engine_client.request_abort(self.run.request_id)
            self.run = None
        self.pending.clear()
        for task in self.tasks:
            task.cancel()
        self.timers_cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- client events -------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        self.last_active = time.monotonic()
        try:
            raw = text_data.encode() if text_data is not None else bytes_data or b""
            limit = settings.IGNIS["server.body_limit"]
            if len(raw) > limit:  # HTTP's limit: answered, and the socket stays open
                raise BodyTooLarge(f"The event is over the {limit}-byte limit.")
            event = parse_json_body(raw)
            kind = event.get("type")
            if kind != "response.create":
                raise InvalidRequest(
                    f"Unknown event type {kind!r}; this socket takes 'response.create'.",
                    param="type",
                    code="unknown_event_type",
                )
        except IgnisError as err:
            await self._error(err)
            return
        self.pending.append(event)
        await self._next()

    async def _next(self) -> None:
        """Start the next waiting response.create, if none is running."""
        while self.run is None and self.pending:
            event = self.pending.popleft()
            body = {k: v for k, v in event.items() if k not in ("type", "stream", "stream_id")}
            try:
                stream_id = event.get("stream_id")
                if stream_id is not None and not isinstance(stream_id, str):
                    raise InvalidRequest("'stream_id' must be a string.", param="stream_id", code="invalid_type")
                await switch_gate(method="POST", path="/v1/responses")
                await model_hold(name=body.get("model"))  # an implicit switch, as over HTTP
                prep = await response_prepare_async(response_parse(body))
            except IgnisError as err:
                await self._error(err)
                continue
            except Exception:  # a bug answers in the envelope and leaves the socket open
                log.exception("ignis.api.unhandled", extra={"path": "/v1/responses (websocket)"})
                await self._error(internal_error())
                continue
            prep.add.reply_channel = self.channel_name
            self.run, self.stream_id, self.started = ResponseRun(prep), stream_id, False
            self.deadline_start(prep.request.deadline, request_id=self.run.request_id)
            await engine_client.request_submit(prep.add)

    # -- engine events -------------------------------------------------------

    def _mine(self, msg: dict) -> bool:
        return self.run is not None and msg["request_id"] == self.run.request_id

    async def _send_events(self, events: list[dict]) -> None:
        self.last_active = time.monotonic()
        for event in events:
            if self.stream_id is not None:
                event["stream_id"] = self.stream_id
            await self.send(text_data=json.dumps(event, separators=(",", ":"), ensure_ascii=False))

    def _opening(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        return self.run.start()

    async def engine_tokens(self, msg: dict) -> None:
        if self._mine(msg):
            events = self._opening()
            await self._send_events(events + self.run.tokens(msg))

    async def engine_finished(self, msg: dict) -> None:
        if not self._mine(msg):
            return
        run = self.run
        events = self._opening() + run.finished(msg)
        if run.prep.request.store:
            await stored_response_save(response=run.response, messages=run.stored_messages())
        await self._send_events(events)
        self.run = None
        await self._next()

    async def engine_failed(self, msg: dict) -> None:
        if not self._mine(msg):
            return
        if msg.get("code") == "engine_full":  # queued, not refused: try again when a lane may be free
            wait = min(max(float(msg.get("retry_after") or 0.0), 0.05), RETRY_MAX_WAIT)
            self._spawn(self._resubmit(self.run, wait))
            return
        run, self.run = self.run, None
        err = error_from_engine(msg)
        if self.started:
            await self._send_events(run.failed("server_error", err.message))
        else:
            await self._error(err)
        await self._next()

    async def deadline_expired(self, msg: dict) -> None:
        """Cut by the deadline, as over HTTP: the output so far, an incomplete response (reason ``deadline``)."""
        if not self._mine(msg):
            return  # that response already ended
        run = self.run
        await engine_client.request_abort(run.request_id)
        await self.engine_finished(
            {
                "request_id": run.request_id,
                "finish_reason": "deadline",
                "prompt_tokens": len(run.prep.add.prompt_token_ids),
                "completion_tokens": run.num_tokens,
                "cached_tokens": run.cached_tokens,
            }
        )

    async def _resubmit(self, run: ResponseRun, wait: float) -> None:
        await asyncio.sleep(wait)
        if self.run is run:
            await engine_client.request_submit(run.prep.add)

    # -- errors and idleness -------------------------------------------------

    async def _error(self, err: IgnisError) -> None:
        self.last_active = time.monotonic()
        await self.send(text_data=json.dumps({"type": "error", **err.envelope()}))

    async def _idle_watch(self, idle: float) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.last_active + idle - time.monotonic()))
            if self.run is None and not self.pending and time.monotonic() - self.last_active >= idle:
                await self.close(code=1000, reason="idle")
                return
            if self.run is not None:
                self.last_active = time.monotonic()
