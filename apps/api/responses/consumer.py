"""POST /v1/responses as a Channels consumer: whole, or streamed as server-sent events.

The shape of the chat consumer (see apps/api/consumer.py): ``handle`` validates and
submits with this consumer's channel as the reply address; each engine round
arrives as ``engine_tokens`` and becomes Responses events. Headers go out
with the first engine event, so an ``engine_full`` refusal is still an HTTP
503 with Retry-After. A finished response is stored (unless ``store`` is
false) before the client hears of it, so an immediate continuation finds it.
"""

from __future__ import annotations

import json

from apps.api.consumer import OpenAIHttpConsumer
from apps.api.responses.events import ResponseRun
from apps.api.responses.service import response_parse, response_prepare_async, stored_response_save
from apps.core import engine_client
from apps.core.errors import error_from_engine


def sse_event(event: dict) -> bytes:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def sse_events(events: list[dict]) -> bytes:
    return b"".join(sse_event(e) for e in events)


class ResponsesConsumer(OpenAIHttpConsumer):
    """POST /v1/responses."""

    async def handle(self, body: dict) -> None:
        prep = await response_prepare_async(response_parse(body))
        self.run = ResponseRun(prep)
        self.stream = prep.request.stream
        prep.add.reply_channel = self.channel_name
        self._request_id = prep.add.request_id
        self.deadline_start(prep.request.deadline)
        if self.stream:
            self.keepalive_start()
        await engine_client.request_submit(prep.add)

    def _mine(self, msg: dict) -> bool:
        return self._request_id is not None and msg["request_id"] == self._request_id

    async def _opening(self) -> list[dict]:
        """response.created and in_progress, once (the headers may have gone out with a keepalive)."""
        if getattr(self, "_opened", False):
            return []
        self._opened = True
        await self.start_stream()
        return self.run.start()

    async def engine_tokens(self, msg: dict) -> None:
        if not self._mine(msg):
            return
        if not self.stream:
            self.run.tokens(msg)
            return
        events = await self._opening()
        events += self.run.tokens(msg)
        if events:
            await self.write(sse_events(events))

    async def engine_finished(self, msg: dict) -> None:
        if self._mine(msg):
            await self._complete(msg)

    async def on_deadline(self) -> None:
        """Cut by the deadline: the output so far, as an incomplete response (reason ``deadline``)."""
        if self._request_id is None:
            return
        await self.abort_all()
        prompt = len(self.run.prep.add.prompt_token_ids)
        await self._complete(
            {
                "finish_reason": "deadline",
                "prompt_tokens": prompt,
                "completion_tokens": self.run.num_tokens,
                "cached_tokens": self.run.cached_tokens,
            }
        )

    async def _complete(self, msg: dict) -> None:
        opening = await self._opening() if self.stream else []
        events = opening + self.run.finished(msg)
        if self.run.prep.request.store:
            await stored_response_save(response=self.run.response, messages=self.run.stored_messages())
        if self.stream:
            await self.end(sse_events(events))
            return
        await self.finish_json(self.run.response)

    async def engine_failed(self, msg: dict) -> None:
        if not self._mine(msg):
            return
        err = error_from_engine(msg)
        if not self._started:
            self._request_id = None
            await self.finish_with_error(err)
            return
        opening = await self._opening()
        await self.end(sse_events(opening + self.run.failed(err.code or "server_error", err.message)))
