"""Streaming routes as Channels consumers, event by event.

A consumer handles one message at a time, so it never loops over a whole
generation inside one handler: ``http_request`` validates and hands the request
to the engine with this consumer's channel as the reply address, then returns
with the consumer alive. Each engine round arrives as its own message
(``engine.tokens`` -> ``engine_tokens``), and ``http.disconnect`` arrives in
the same dispatch loop, so a client that goes away aborts its sequence at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from channels.consumer import AsyncConsumer
from channels.exceptions import StopConsumer
from django.conf import settings

from apps.api import engine_client
from apps.api.errors import BodyTooLarge, IgnisError, error_from_engine
from apps.api.services import PreparedChat, chat_prepare
from apps.api.streaming import TextStream, chat_chunk, now, sse, usage_block
from apps.api.validation import parse_json_body
from apps.models.switching import model_hold, switch_gate

log = logging.getLogger("ignis.api")
JSON = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class OpenAIHttpConsumer(AsyncConsumer):
    """Collects the body, answers errors in the OpenAI envelope, tracks the engine request."""

    methods = ("POST",)

    async def websocket_connect(self, message):  # pragma: no cover - routed only for http
        raise StopConsumer()

    async def __call__(self, scope, receive, send):
        self._body = bytearray()
        self._request_id: str | None = None
        self._started = False
        return await super().__call__(scope, receive, send)

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

    async def handle(self, body: dict) -> None:
        raise NotImplementedError

    async def http_disconnect(self, message: dict) -> None:
        if self._request_id is not None:
            await engine_client.request_abort(self._request_id)
            self._request_id = None
        raise StopConsumer()

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
        self._request_id = None
        await self.send({"type": "http.response.body", "body": data, "more_body": False})
        raise StopConsumer()

    async def finish_with_error(self, err: IgnisError) -> None:
        """An error before the stream began is an HTTP status; after, a final SSE event."""
        if self._request_id is not None:
            await engine_client.request_abort(self._request_id)
        if self._started:
            await self.end(sse(err.envelope()) + sse("[DONE]"))
        await self.send_json(err.status, err.envelope(), err.headers())
        raise StopConsumer()


class ChatCompletionsConsumer(OpenAIHttpConsumer):
    """POST /v1/chat/completions, streamed (SSE chunks) or whole."""

    async def handle(self, body: dict) -> None:
        prep: PreparedChat = await asyncio.to_thread(chat_prepare, body)
        self.prep = prep
        self.created = now()
        self.text = TextStream(prep.served.tokenizer, prep.request.stop, prep.add.prompt_token_ids)
        self.num_tokens = 0
        self.cached_tokens = 0
        self.t_submit = time.monotonic()
        prep.add.reply_channel = self.channel_name
        self._request_id = prep.add.request_id
        await engine_client.request_submit(prep.add)

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        return sse(chat_chunk(self.prep.add.request_id, self.prep.served.served_id, self.created, delta,
                              finish_reason))

    async def engine_tokens(self, msg: dict) -> None:
        if msg["request_id"] != self._request_id:
            return
        self.num_tokens += len(msg["token_ids"])
        self.cached_tokens = msg.get("cached_tokens", self.cached_tokens)
        piece = self.text.feed(msg["token_ids"])
        if self.prep.request.stream:
            if not self._started:
                await self.start_stream()
                await self.write(self._chunk({"role": "assistant", "content": ""}))
            if piece:
                await self.write(self._chunk({"content": piece}))
        if self.text.stopped:
            await engine_client.request_abort(self._request_id)
            await self.complete("stop", len(self.prep.add.prompt_token_ids), self.num_tokens, self.cached_tokens)

    async def engine_finished(self, msg: dict) -> None:
        if msg["request_id"] != self._request_id:
            return
        reason = msg["finish_reason"]
        await self.complete("length" if reason == "length" else "stop", msg["prompt_tokens"],
                            msg["completion_tokens"], msg.get("cached_tokens", 0))

    async def engine_failed(self, msg: dict) -> None:
        if msg["request_id"] != self._request_id:
            return
        self._request_id = None
        await self.finish_with_error(error_from_engine(msg))

    async def complete(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached: int) -> None:
        tail = self.text.flush()
        usage = usage_block(prompt_tokens, completion_tokens, cached)
        req, prep = self.prep.request, self.prep
        if not req.stream:
            await self.send_json(200, {
                "id": prep.add.request_id, "object": "chat.completion", "created": self.created,
                "model": prep.served.served_id, "system_fingerprint": "ignis",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text.text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage,
            })
            self._request_id = None
            raise StopConsumer()
        await self.start_stream()
        out = self._chunk({"content": tail}) if tail else b""
        out += self._chunk({}, finish_reason)
        if req.include_usage:
            out += sse(chat_chunk(prep.add.request_id, prep.served.served_id, self.created, {}, usage=usage,
                                  choices=False))
        await self.end(out + sse("[DONE]"))
