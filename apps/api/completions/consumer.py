"""POST /v1/completions, the consumer: legacy text completions (load tools and older clients), streamed or whole.

The prompt is used as given (text, several texts, token ids), with no chat
template. ``echo`` puts the prompt in front of each choice's text; with
``logprobs`` the prompt's tokens are listed too, scored by the engine
(``AddRequest.prompt_logprobs``; the first token has ``null``, as in OpenAI's
API). ``max_tokens: 0`` with ``echo`` answers with the prompt alone and never
reaches the engine (its prompt logprobs stay ``null``).
"""

from __future__ import annotations

import asyncio

from apps.api.completions.service import PreparedCompletion, completion_prepare
from apps.api.consumer import Choice, MultiRequestConsumer
from apps.api.logprobs import LegacyLogprobs
from apps.api.streaming import TextStream, now, sse
from engine.messages import AddRequest


class CompletionsConsumer(MultiRequestConsumer):
    async def handle(self, body: dict) -> None:
        prep: PreparedCompletion = await asyncio.to_thread(completion_prepare, body)
        self.prep = prep
        req, tok = prep.request, prep.served.tokenizer
        self.legacy: dict[int, LegacyLogprobs] = {}
        self.texts: dict[int, str] = {}
        if not prep.adds:  # max_tokens 0 with echo: the prompt is the answer
            self.created = now()
            self.order = [
                Choice(i, AddRequest(f"{prep.id}-{i}", "", ids, 0), TextStream(tok, []))
                for i, ids in enumerate(prep.prompt_ids)
            ]
            for c in self.order:
                c.finish_reason = "length"
                self._echo(c)
            await self.respond()
            return
        choices = [Choice(i, add, TextStream(tok, req.stop, add.prompt_token_ids)) for i, add in enumerate(prep.adds)]
        for c in choices:
            self._echo(c)
        await self.submit(prep.adds, choices, req.deadline, req.stream)

    def _echo(self, choice: Choice) -> None:
        req = self.prep.request
        text = self.prep.prompt_texts[choice.index] if req.echo else ""
        self.texts[choice.index] = text
        if req.logprobs is not None:
            lp = self.legacy[choice.index] = LegacyLogprobs(self.prep.served.tokenizer, req.logprobs)
            if req.echo:
                for t in self.prep.prompt_ids[choice.index]:
                    lp.add(t, None, None)
                lp.offset = len(text)

    async def engine_tokens(self, msg: dict) -> None:
        self._prompt_scores(msg)
        await super().engine_tokens(msg)

    async def engine_finished(self, msg: dict) -> None:
        self._prompt_scores(msg)
        await super().engine_finished(msg)

    def _prompt_scores(self, msg: dict) -> None:
        """The engine's prompt logprobs (first event) into the echoed entries, before the echo is sent."""
        choice, items = self._live(msg), msg.get("prompt_logprobs")
        lp = self.legacy.get(choice.index) if choice is not None else None
        if lp is None or not items or not self.prep.request.echo:
            return
        for i, item in enumerate(items[: len(self.prep.prompt_ids[choice.index]) - 1], start=1):
            lp.score(i, item["logprob"], [tuple(t) for t in item.get("top", [])])

    def _chunk(
        self,
        choice: Choice,
        text: str,
        logprobs: dict | None,
        finish_reason: str | None = None,
        usage: dict | None = None,
    ) -> dict:
        body = {
            "id": self.prep.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.prep.served.served_id,
            "system_fingerprint": "ignis",
            "choices": [{"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if usage is not None:
            body["usage"] = usage
        return body

    async def _open(self, choice: Choice) -> None:
        await self.start_stream()
        if not choice.opened:
            choice.opened = True
            lp = self.legacy.get(choice.index)
            if self.texts[choice.index] or lp is not None:
                await self.write(sse(self._chunk(choice, self.texts[choice.index], lp.as_dict() if lp else None)))

    async def on_token(self, choice: Choice, token_id: int) -> None:
        piece = choice.text.feed([token_id])
        self.texts[choice.index] += piece
        lp_chunk = None
        legacy = self.legacy.get(choice.index)
        if legacy is not None:
            item = choice.pending_logprobs.pop(0) if choice.pending_logprobs else None
            if item is not None:
                lp_chunk = legacy.add(item["token_id"], item["logprob"], [tuple(t) for t in item.get("top", [])])
        if self.prep.request.stream:
            await self._open(choice)
            if piece or lp_chunk:
                await self.write(sse(self._chunk(choice, piece, lp_chunk)))

    async def on_choice_done(self, choice: Choice) -> None:
        tail = choice.text.flush()
        self.texts[choice.index] += tail
        if self.prep.request.stream:
            await self._open(choice)
            await self.write(sse(self._chunk(choice, tail, None, choice.finish_reason)))

    async def respond(self) -> None:
        req = self.prep.request
        if not req.stream:
            choices = [
                {
                    "index": c.index,
                    "text": self.texts[c.index],
                    "logprobs": self.legacy[c.index].as_dict() if c.index in self.legacy else None,
                    "finish_reason": c.finish_reason,
                }
                for c in self.order
            ]
            await self.finish_json(self.whole_body("text_completion", choices))
            return
        if not self._started:
            for c in self.order:
                await self._open(c)
                await self.write(sse(self._chunk(c, "", None, c.finish_reason)))
        out = b""
        if req.include_usage:
            body = self._chunk(self.order[0], "", None, usage=self.usage())
            body["choices"] = []
            out += sse(body)
        await self.end(out + sse("[DONE]"))
