"""POST /v1/decisions: prefill-only decide requests, one per question, answered from their logprobs.

The first question's request goes alone and prefills the whole input; the
others are submitted once it has finished, so each claims the input's
retained blocks and computes only its own suffix (the engine reports what it
claimed as ``cached_tokens``). Nothing is decoded and no decode lane is taken.
"""

from __future__ import annotations

import asyncio

from apps.api.consumer import OpenAIHttpConsumer
from apps.api.decisions.service import QuestionResult, decisions_prepare, decisions_render, remap
from apps.core import engine_client
from apps.core.errors import engine_error, error_from_engine
from engine.messages import AddRequest


class DecisionsConsumer(OpenAIHttpConsumer):
    async def handle(self, body: dict) -> None:
        self.prep = await asyncio.to_thread(decisions_prepare, body)
        self.order = {add.request_id: i for i, add in enumerate(self.prep.adds)}
        self.results: dict[int, QuestionResult] = {}
        for add in self.prep.adds:
            add.reply_channel = self.channel_name
        self.deadline_start(None)
        await self._submit(self.prep.adds[:1])

    async def _submit(self, adds: list[AddRequest]) -> None:
        for add in adds:
            self._request_ids.add(add.request_id)
            await engine_client.request_submit(add)

    async def engine_tokens(self, msg: dict) -> None:  # a decide request decodes nothing
        return

    async def engine_finished(self, msg: dict) -> None:
        request_id = msg["request_id"]
        if request_id not in self._request_ids:
            return
        self._request_ids.discard(request_id)
        i = self.order[request_id]
        ids, lps = self.prep.adds[i].decide_token_ids, msg.get("decide_logprobs")
        if msg.get("finish_reason") == "abort" or lps is None or len(lps) != len(ids):
            await self.finish_with_error(engine_error(f"The engine returned no answer for question {i}."))
            return
        self.results[i] = QuestionResult(dict(zip(ids, lps)), msg["prompt_tokens"], msg.get("cached_tokens", 0))
        if i == 0:
            await self._submit(self.prep.adds[1:])
        if len(self.results) == len(self.prep.adds):
            results = [self.results[k] for k in range(len(self.prep.adds))]
            await self.finish_json(decisions_render(self.prep, results))

    async def engine_failed(self, msg: dict) -> None:
        if msg["request_id"] not in self._request_ids:
            return
        self._request_ids.discard(msg["request_id"])
        await self.finish_with_error(remap(error_from_engine(msg)))
