"""The consumers' base: one HTTP request (or WebSocket response) driven event by event.

A consumer handles one message at a time, so it never loops over a whole
generation inside one handler: ``http_request`` validates and hands the request
to the engine with this consumer's channel as the reply address, then returns
with the consumer alive. Each engine round arrives as its own message
(``engine.tokens`` -> ``engine_tokens``), and ``http.disconnect`` arrives in
the same dispatch loop, so a client that goes away aborts its sequences at
once (within the engine's next round).

Timers are messages too (``Timers``, shared with the WebSocket consumer): the
deadline sends ``deadline.expired`` and a stream's keepalive ``stream.keepalive``
to this consumer's own channel, so they are handled between engine events, never
in the middle of one. What a cut request is answered with is documented in
docs/API.md (Deadlines): its output so far, ``finish_reason: "deadline"``.

A stream's headers go out with the first engine event, or at the first
keepalive tick (``KEEPALIVE_FIRST`` s, then a ``: keepalive`` comment every
``server.sse_keepalive`` s while nothing else is written), whichever comes
first; so an ``engine_full`` refusal, answered at admission, is still an HTTP
503 with Retry-After, and a proxy with a read timeout never waits on a long
queue or prefill.

Handlers finish by returning: ``end``, ``finish_json`` and ``finish_with_error``
mark the consumer finished, and ``dispatch`` stops it once the handler returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from channels.consumer import AsyncConsumer, get_handler_name
from channels.exceptions import StopConsumer
from django.conf import settings

from apps.api.output_split import OutputSplitter
from apps.api.parsers import parse_json_body
from apps.api.streaming import TextStream, now, sse
from apps.api.usage import usage_block
from apps.core import engine_client
from apps.core.errors import BodyTooLarge, IgnisError, error_from_engine, internal_error
from apps.models.switching import model_hold, switch_gate
from engine.messages import AddRequest

log = logging.getLogger("ignis.api")
JSON = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DEADLINE = "deadline"  # the finish_reason of a request cut by its deadline
KEEPALIVE = b": keepalive\n\n"
KEEPALIVE_FIRST = 1.0  # seconds before a silent stream sends its headers (an admission refusal comes sooner)


class Timers:
    """Timer tasks that send a message to this consumer's own channel (the deadline, the keepalive)."""

    def timer_start(self, seconds: float, message: dict, *, every: float | None = None) -> None:
        timers = self.__dict__.setdefault("_timers", set())
        task = asyncio.ensure_future(self._timer(seconds, message, every))
        timers.add(task)
        task.add_done_callback(timers.discard)

    async def _timer(self, seconds: float, message: dict, every: float | None) -> None:
        await asyncio.sleep(seconds)
        while True:
            await self.channel_layer.send(self.channel_name, dict(message))
            if not every:
                return
            await asyncio.sleep(every)

    def timers_cancel(self) -> None:
        for task in list(self.__dict__.get("_timers", ())):
            task.cancel()

    def deadline_start(self, requested: float | None, *, request_id: str | None = None) -> None:
        """Start the clock: the request's own deadline, else ``server.deadline`` (0: none).
        Past it, ``deadline.expired`` (with ``request_id``) arrives as a message."""
        seconds = requested or settings.IGNIS.get("server.deadline", 0)
        if seconds:
            self.timer_start(seconds, {"type": "deadline.expired", "request_id": request_id})


class OpenAIHttpConsumer(Timers, AsyncConsumer):
    """Collects the body, answers errors in the OpenAI envelope, tracks its engine requests.

    ``_request_ids`` are the live engine requests (a disconnect or an error aborts
    them all); ``_request_id`` reads and sets the single one of one-request routes.
    """

    methods = ("POST",)

    async def websocket_connect(self, message):  # pragma: no cover - routed only for http
        raise StopConsumer()

    async def __call__(self, scope, receive, send):
        self._body = bytearray()
        self._request_ids: set[str] = set()
        self._started = False
        self._finished = False
        self._last_write = 0.0
        try:
            return await super().__call__(scope, receive, send)
        finally:
            self.timers_cancel()

    async def dispatch(self, message: dict) -> None:
        """One message to its handler; once a handler has finished the response, the consumer stops.

        Not through Channels' own dispatch: that first runs Django's close_old_connections on the
        one sync thread, a round trip between threads for every message (each engine.tokens of
        every stream, all queued on that thread); these handlers reach the database only through
        database_sync_to_async, which closes stale connections itself."""
        engine_client.reply_heard(message)
        if self._finished:
            raise StopConsumer()
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)
        if self._finished:
            raise StopConsumer()

    @property
    def _request_id(self) -> str | None:
        return next(iter(self._request_ids), None)

    @_request_id.setter
    def _request_id(self, value: str | None) -> None:
        self._request_ids = {value} if value is not None else set()

    async def http_request(self, message: dict) -> None:
        self._body += message.get("body", b"")
        try:
            if len(self._body) > settings.IGNIS["server.body_limit"]:
                raise BodyTooLarge(f"The request body is over the {settings.IGNIS['server.body_limit']}-byte limit.")
            if message.get("more_body"):
                return
            if self.scope["method"] not in self.methods:
                raise IgnisError(f"Use {' or '.join(self.methods)} here.", code="method_not_allowed", status=405)
            await switch_gate(method=self.scope["method"], path=self.scope["path"])
            body = parse_json_body(bytes(self._body))
            await model_hold(name=body.get("model") if isinstance(body, dict) else None)  # implicit switch
            await self.handle(body)
        except IgnisError as err:
            await self.finish_with_error(err)
        except Exception:  # a bug must still answer in the envelope, and free what it holds
            log.exception("ignis.api.unhandled", extra={"path": self.scope.get("path")})
            await self.finish_with_error(internal_error())

    async def handle(self, body: dict) -> None:
        raise NotImplementedError

    async def abort_all(self) -> None:
        ids, self._request_ids = self._request_ids, set()
        for request_id in ids:
            await engine_client.request_abort(request_id)

    async def http_disconnect(self, message: dict) -> None:
        await self.abort_all()
        self._finished = True

    # -- timers ------------------------------------------------------------------------------

    async def deadline_expired(self, message: dict) -> None:
        await self.on_deadline()

    async def on_deadline(self) -> None:
        """Routes that can answer with partial output override this; the default is a 504."""
        await self.finish_with_error(
            IgnisError("The request ran past its deadline.", type="server_error", code="deadline_exceeded", status=504)
        )

    def keepalive_start(self) -> None:
        """A streamed response: headers at the first tick at the latest, then a comment while silent."""
        every = settings.IGNIS.get("server.sse_keepalive", 0)
        if every:
            self.timer_start(min(KEEPALIVE_FIRST, every), {"type": "stream.keepalive"}, every=every)

    async def stream_keepalive(self, message: dict) -> None:
        every = settings.IGNIS.get("server.sse_keepalive", 0)
        if not self._started:
            await self.start_stream()
            await self.write(KEEPALIVE)
        elif every and time.monotonic() - self._last_write >= every * 0.9:
            await self.write(KEEPALIVE)

    # -- writing -------------------------------------------------------------------------

    async def send_json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await self.send({"type": "http.response.start", "status": status, "headers": JSON + extra})
        await self.send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    async def finish_json(self, payload: dict, status: int = 200) -> None:
        """The whole (non-streamed) answer; the consumer is finished."""
        self._request_ids = set()
        self._finished = True
        await self.send_json(status, payload)

    async def start_stream(self) -> None:
        if not self._started:
            self._started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def write(self, data: bytes) -> None:
        self._last_write = time.monotonic()
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        """The stream's last bytes; the consumer is finished."""
        self._request_ids = set()
        self._finished = True
        await self.send({"type": "http.response.body", "body": data, "more_body": False})

    async def finish_with_error(self, err: IgnisError) -> None:
        """An error before the stream began is an HTTP status; after, a final SSE event. Finished either way."""
        await self.abort_all()
        if self._started:
            await self.end(sse(err.envelope()) + sse("[DONE]"))
            return
        self._finished = True
        await self.send_json(err.status, err.envelope(), err.headers())


class Choice:
    """One engine request's share of a response: its text, channels, tokens and logprobs."""

    def __init__(self, index: int, add: AddRequest, text: TextStream, splitter: OutputSplitter | None = None):
        self.index = index
        self.add = add
        self.text = text
        self.splitter = splitter
        self.num_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.prediction_tokens = (0, 0)  # Predicted Outputs: (accepted, rejected), from RequestFinished
        self.speculation = (0, 0)  # every drafter's (drafted, accepted), from RequestFinished
        self.taken_back: list[dict] = []  # take-backs (loop guard, thinking budget): {tokens, reason}
        self.taken_back_tokens = 0  # from RequestFinished
        self.forcing = False  # the token being fed was forced (a take-back's end of thinking): not reasoning
        self.finish_reason: str | None = None
        self.logprobs: list[dict] = []  # engine items, all of them
        self.pending_logprobs: list[dict] = []  # not yet attached to a streamed chunk
        self.opened = False  # the stream sent this choice's role chunk

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class MultiRequestConsumer(OpenAIHttpConsumer):
    """A response made of n engine requests (choices), each tracked on its own.

    Subclasses build ``self.choices`` and implement ``on_token`` (one token at a
    time, even when a round committed several), ``on_choice_done`` and ``respond``.
    """

    async def submit(self, adds: list[AddRequest], choices: list[Choice], deadline: float | None, stream: bool) -> None:
        self.choices = {c.add.request_id: c for c in choices}
        self.order = choices
        self.created = now()
        for add in adds:
            add.reply_channel = self.channel_name
            self._request_ids.add(add.request_id)
        self.deadline_start(deadline)
        if stream:
            self.keepalive_start()
        for add in adds:
            await engine_client.request_submit(add)

    def _live(self, msg: dict) -> Choice | None:
        choice = getattr(self, "choices", {}).get(msg.get("request_id"))
        return None if choice is None or choice.done else choice

    async def engine_tokens(self, msg: dict) -> None:
        choice = self._live(msg)
        if choice is None:
            return
        choice.cached_tokens = msg.get("cached_tokens", choice.cached_tokens)
        if msg.get("taken_back_reason"):  # before the forced end of the thinking these tokens are
            marker = {"tokens": msg.get("taken_back", 0), "reason": msg["taken_back_reason"]}
            choice.taken_back.append(marker)
            await self.on_take_back(choice, marker)
        lps = msg.get("logprobs") or []
        for i, token_id in enumerate(msg["token_ids"]):
            choice.num_tokens += 1
            choice.forcing = bool(msg.get("taken_back_reason"))
            if i < len(lps):
                choice.logprobs.append(lps[i])
                choice.pending_logprobs.append(lps[i])
            await self.on_token(choice, token_id)
            if choice.text.stopped:  # a stop string: the rest of the round is past it
                await self._finish_choice(choice, "stop", abort=True)
                return

    async def engine_finished(self, msg: dict) -> None:
        choice = self._live(msg)
        if choice is None:
            return
        choice.num_tokens = msg.get("completion_tokens", choice.num_tokens)
        choice.cached_tokens = msg.get("cached_tokens", choice.cached_tokens)
        choice.prediction_tokens = (msg.get("accepted_prediction_tokens", 0), msg.get("rejected_prediction_tokens", 0))
        choice.speculation = (msg.get("spec_drafted", 0), msg.get("spec_accepted", 0))
        choice.taken_back_tokens = msg.get("taken_back_tokens", 0)
        await self._finish_choice(choice, "length" if msg["finish_reason"] == "length" else "stop")

    async def engine_failed(self, msg: dict) -> None:
        if self._live(msg) is None:
            return
        self._request_ids.discard(msg["request_id"])
        await self.finish_with_error(error_from_engine(msg))

    async def on_deadline(self) -> None:
        for choice in self.order:
            if not choice.done:
                await self._finish_choice(choice, DEADLINE, abort=True)

    async def _finish_choice(self, choice: Choice, reason: str, *, abort: bool = False) -> None:
        choice.finish_reason = reason
        if choice.add.request_id in self._request_ids:
            self._request_ids.discard(choice.add.request_id)
            if abort:
                await engine_client.request_abort(choice.add.request_id)
        await self.on_choice_done(choice)
        if all(c.done for c in self.order):
            await self.respond()

    def usage(self) -> dict:
        prompts = {id(c.add.prompt_token_ids): len(c.add.prompt_token_ids) for c in self.order}
        usage = usage_block(
            sum(prompts.values()),
            sum(c.num_tokens for c in self.order),
            max(c.cached_tokens for c in self.order),
            reasoning_tokens=sum(c.reasoning_tokens for c in self.order),
            prediction=(
                (sum(c.prediction_tokens[0] for c in self.order), sum(c.prediction_tokens[1] for c in self.order))
                if self.prep_has_prediction
                else None
            ),
        )
        taken_back = sum(c.taken_back_tokens for c in self.order)
        if taken_back and "completion_tokens_details" in usage:  # extension: counted in completion_tokens
            usage["completion_tokens_details"]["taken_back_tokens"] = taken_back
        drafted = sum(c.speculation[0] for c in self.order)
        if drafted:  # extension: what speculative rounds did for this answer (docs/API.md)
            usage["speculation"] = {"drafted": drafted, "accepted": sum(c.speculation[1] for c in self.order)}
        return usage

    @property
    def prep_has_prediction(self) -> bool:
        return any(c.add.prediction_token_ids is not None for c in self.order)

    def whole_body(self, object_: str, choices: list[dict]) -> dict:
        """The non-streamed answer of chat and text completions."""
        return {
            "id": self.prep.id,
            "object": object_,
            "created": self.created,
            "model": self.prep.served.served_id,
            "system_fingerprint": "ignis",
            "choices": choices,
            "usage": self.usage(),
        }

    async def on_token(self, choice: Choice, token_id: int) -> None:
        raise NotImplementedError

    async def on_take_back(self, choice: Choice, marker: dict) -> None:
        """The engine took back ``marker["tokens"]`` streamed tokens (docs/API.md, Loop guard and
        thinking budget); the forced end of the thinking follows. Routes that show it override this."""

    async def on_choice_done(self, choice: Choice) -> None:
        raise NotImplementedError

    async def respond(self) -> None:
        raise NotImplementedError
