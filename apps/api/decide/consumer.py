"""POST /v1/decide, the consumer: submit a prefill-only request, answer from its logits."""

from __future__ import annotations

import asyncio

from apps.api.consumer import OpenAIHttpConsumer
from apps.api.decide.service import decide_prepare, decision_render
from apps.core import engine_client
from apps.core.errors import engine_error, error_from_engine


class DecideConsumer(OpenAIHttpConsumer):
    """POST /v1/decide: submit a prefill-only request, answer from its logits."""

    async def handle(self, body: dict) -> None:
        self.prep = await asyncio.to_thread(decide_prepare, body)
        self.prep.add.reply_channel = self.channel_name
        self._request_id = self.prep.add.request_id
        await engine_client.request_submit(self.prep.add)

    async def engine_tokens(self, msg: dict) -> None:  # a decide request decodes nothing
        return

    async def engine_finished(self, msg: dict) -> None:
        if msg["request_id"] != self._request_id:
            return
        self._request_id = None
        logits, ids, lps = msg.get("logits"), self.prep.add.decide_token_ids, msg.get("decide_logprobs")
        logprobs = dict(zip(ids, lps)) if lps is not None and len(lps) == len(ids) else None
        if not logits and logprobs is None:
            await self.finish_with_error(engine_error("The engine returned no logits for this decision."))
            return
        decision = await asyncio.to_thread(
            decision_render, self.prep, logits, msg["prompt_tokens"], msg.get("cached_tokens", 0), logprobs
        )
        await self.finish_json(decision)

    async def engine_failed(self, msg: dict) -> None:
        if msg["request_id"] != self._request_id:
            return
        self._request_id = None
        await self.finish_with_error(error_from_engine(msg))
