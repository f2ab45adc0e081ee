"""Streaming routes as Channels consumers, event by event.

A consumer handles one message at a time, so it never loops over a whole
generation inside one handler: ``http_request`` validates and hands the request
to the engine with this consumer's channel as the reply address, then returns
with the consumer alive. Each engine round arrives as its own message
(``engine.tokens`` -> ``engine_tokens``), and ``http.disconnect`` arrives in
the same dispatch loop, so a client that goes away aborts its sequences at
once (within the engine's next round).

The deadline clock is a message too: a timer task sends ``deadline.expired``
to this consumer's own channel, so it is handled between engine events, never
in the middle of one. What a cut request is answered with is documented in
docs/API.md (Deadlines): its output so far, ``finish_reason: "deadline"``.

Response headers go out with the first engine event, so an ``engine_full``
refusal is still an HTTP 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import logging

from channels.consumer import AsyncConsumer
from channels.exceptions import StopConsumer
from django.conf import settings

from apps.api import engine_client
from apps.api.channels_split import ChannelSplitter
from apps.api.errors import BodyTooLarge, IgnisError, error_from_engine
from apps.api.logprobs import chat_logprobs
from apps.api.parsers import parse_json_body
from apps.api.services import PreparedChat, chat_prepare
from apps.api.streaming import TextStream, chat_chunk, now, sse, usage_block
from apps.models.switching import model_hold, switch_gate
from engine.messages import AddRequest

log = logging.getLogger("ignis.api")
JSON = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DEADLINE = "deadline"  # the finish_reason of a request cut by its deadline


class OpenAIHttpConsumer(AsyncConsumer):
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
        self._deadline_task: asyncio.Task | None = None
        try:
            return await super().__call__(scope, receive, send)
        finally:
            if self._deadline_task is not None:
                self._deadline_task.cancel()

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
        except StopConsumer:
            raise
        except Exception:  # a bug must still answer in the envelope, and free what it holds
            log.exception("ignis.api.unhandled", extra={"path": self.scope.get("path")})
            await self.finish_with_error(
                IgnisError(
                    "The server had an error while processing your request.",
                    type="server_error",
                    code="internal_error",
                    status=500,
                )
            )

    async def handle(self, body: dict) -> None:
        raise NotImplementedError

    async def abort_all(self) -> None:
        ids, self._request_ids = self._request_ids, set()
        for request_id in ids:
            await engine_client.request_abort(request_id)

    async def http_disconnect(self, message: dict) -> None:
        await self.abort_all()
        raise StopConsumer()

    # -- the deadline clock --------------------------------------------------------------

    def deadline_start(self, requested: float | None) -> None:
        """Start the clock: the request's own deadline, else ``server.deadline`` (0: none)."""
        seconds = requested or settings.IGNIS.get("server.deadline", 0)
        if seconds:
            self._deadline_task = asyncio.ensure_future(self._deadline_after(seconds))

    async def _deadline_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.channel_layer.send(self.channel_name, {"type": "deadline.expired"})

    async def deadline_expired(self, message: dict) -> None:
        await self.on_deadline()

    async def on_deadline(self) -> None:
        """Routes that can answer with partial output override this; the default is a 504."""
        await self.finish_with_error(
            IgnisError("The request ran past its deadline.", type="server_error", code="deadline_exceeded", status=504)
        )

    # -- writing -------------------------------------------------------------------------

    async def send_json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await self.send({"type": "http.response.start", "status": status, "headers": JSON + extra})
        await self.send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    async def start_stream(self) -> None:
        if not self._started:
            self._started = True
            await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self._request_ids = set()
        await self.send({"type": "http.response.body", "body": data, "more_body": False})
        raise StopConsumer()

    async def finish_with_error(self, err: IgnisError) -> None:
        """An error before the stream began is an HTTP status; after, a final SSE event."""
        await self.abort_all()
        if self._started:
            await self.end(sse(err.envelope()) + sse("[DONE]"))
        await self.send_json(err.status, err.envelope(), err.headers())
        raise StopConsumer()


class Choice:
    """One engine request's share of a response: its text, channels, tokens and logprobs."""

    def __init__(self, index: int, add: AddRequest, text: TextStream, splitter: ChannelSplitter | None = None):
        self.index = index
        self.add = add
        self.text = text
        self.splitter = splitter
        self.num_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
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

    async def submit(self, adds: list[AddRequest], choices: list[Choice], deadline: float | None) -> None:
        self.choices = {c.add.request_id: c for c in choices}
        self.order = choices
        self.created = now()
        for add in adds:
            add.reply_channel = self.channel_name
            self._request_ids.add(add.request_id)
        self.deadline_start(deadline)
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
        lps = msg.get("logprobs") or []
        for i, token_id in enumerate(msg["token_ids"]):
            choice.num_tokens += 1
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
            sum(prompts.values()), sum(c.num_tokens for c in self.order), max(c.cached_tokens for c in self.order)
        )
        usage["completion_tokens_details"]["reasoning_tokens"] = sum(c.reasoning_tokens for c in self.order)
        return usage

    async def on_token(self, choice: Choice, token_id: int) -> None:
        raise NotImplementedError

    async def on_choice_done(self, choice: Choice) -> None:
        raise NotImplementedError

    async def respond(self) -> None:
        raise NotImplementedError


class ChatCompletionsConsumer(MultiRequestConsumer):
    """POST /v1/chat/completions, streamed (SSE chunks) or whole; n choices; reasoning and tool calls."""

    async def handle(self, body: dict) -> None:
        prep: PreparedChat = await asyncio.to_thread(chat_prepare, body)
        self.prep = prep
        req, tok = prep.request, prep.served.tokenizer
        choices = [
            Choice(
                i,
                add,
                TextStream(tok, req.stop, add.prompt_token_ids),
                ChannelSplitter(in_reasoning=prep.in_reasoning, parse_tools=prep.parse_tools),
            )
            for i, add in enumerate(prep.adds)
        ]
        await self.submit(prep.adds, choices, req.deadline)

    def _chunk(self, choice: Choice, delta: dict, finish_reason: str | None = None) -> bytes:
        chunk = chat_chunk(self.prep.id, self.prep.served.served_id, self.created, delta, finish_reason)
        chunk["choices"][0]["index"] = choice.index
        if self.prep.request.logprobs and choice.pending_logprobs:
            items, choice.pending_logprobs = choice.pending_logprobs, []
            chunk["choices"][0]["logprobs"] = {
                "content": chat_logprobs(self.prep.served.tokenizer, items, self.prep.request.top_logprobs),
                "refusal": None,
            }
        return sse(chunk)

    def _deltas(self, choice: Choice, events) -> list[dict]:
        deltas = []
        for ev in events:
            if ev.kind == "content":
                deltas.append({"content": ev.text})
            elif ev.kind == "reasoning":
                deltas.append({"reasoning_content": ev.text, "reasoning": ev.text})  # the field newer servers use
            elif ev.kind == "tool_call_start":  # the name first, then the arguments as they arrive
                call = ev.call
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": call.index,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            elif ev.kind == "tool_call_args":
                deltas.append({"tool_calls": [{"index": ev.call.index, "function": {"arguments": ev.text}}]})
        return deltas

    async def _open(self, choice: Choice) -> None:
        await self.start_stream()
        if not choice.opened:
            choice.opened = True
            await self.write(self._chunk(choice, {"role": "assistant", "content": ""}))

    async def on_token(self, choice: Choice, token_id: int) -> None:
        if choice.splitter.mode == "reasoning":
            choice.reasoning_tokens += 1
        events = choice.splitter.feed(choice.text.feed([token_id]))
        if self.prep.request.stream:
            await self._open(choice)
            out = b"".join(self._chunk(choice, d) for d in self._deltas(choice, events))
            if out:
                await self.write(out)

    async def on_choice_done(self, choice: Choice) -> None:
        events = choice.splitter.feed(choice.text.flush()) + choice.splitter.flush()
        if choice.finish_reason == "stop" and choice.splitter.tool_calls:
            choice.finish_reason = "tool_calls"
        if not self.prep.request.stream:
            return
        await self._open(choice)
        out = b"".join(self._chunk(choice, d) for d in self._deltas(choice, events))
        await self.write(out + self._chunk(choice, {}, choice.finish_reason))

    def _message(self, choice: Choice) -> dict:
        sp = choice.splitter
        msg = {"role": "assistant", "content": sp.content if sp.content or not sp.tool_calls else None}
        if sp.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = sp.reasoning
        if sp.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in sp.tool_calls
            ]
        return msg

    async def respond(self) -> None:
        req, prep = self.prep.request, self.prep
        usage = self.usage()
        if not req.stream:
            choices = []
            for c in self.order:
                lp = None
                if req.logprobs:
                    lp = {
                        "content": chat_logprobs(prep.served.tokenizer, c.logprobs, req.top_logprobs),
                        "refusal": None,
                    }
                choices.append(
                    {"index": c.index, "message": self._message(c), "logprobs": lp, "finish_reason": c.finish_reason}
                )
            await self.send_json(
                200,
                {
                    "id": prep.id,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": prep.served.served_id,
                    "system_fingerprint": "ignis",
                    "choices": choices,
                    "usage": usage,
                },
            )
            self._request_ids = set()
            raise StopConsumer()
        out = b""
        if req.include_usage:
            out += sse(chat_chunk(prep.id, prep.served.served_id, self.created, {}, usage=usage, choices=False))
        await self.end(out + sse("[DONE]"))
