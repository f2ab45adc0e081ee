"""POST /v1/chat/completions, the consumer: streamed (SSE chunks) or whole; n choices; reasoning and tool calls."""

from __future__ import annotations

import asyncio

from apps.api.chat.service import PreparedChat, chat_prepare
from apps.api.consumer import Choice, MultiRequestConsumer
from apps.api.harmony_split import splitter_for
from apps.api.logprobs import chat_logprobs
from apps.api.streaming import ChatChunks, TextStream, chat_chunk, sse


class ChatCompletionsConsumer(MultiRequestConsumer):
    """POST /v1/chat/completions, streamed (SSE chunks) or whole; n choices; reasoning and tool calls."""

    _chunks: ChatChunks | None = None  # made with the first chunk (``created`` is set at submit)

    async def handle(self, body: dict) -> None:
        prep: PreparedChat = await asyncio.to_thread(chat_prepare, body)
        self.prep = prep
        req, tok = prep.request, prep.served.tokenizer
        choices = [
            Choice(
                i,
                add,
                TextStream(
                    tok, req.stop, add.prompt_token_ids, skip_special_tokens=not prep.parsers.keep_special_tokens
                ),
                splitter_for(in_reasoning=prep.in_reasoning, parse_tools=prep.parse_tools, parsers=prep.parsers),
            )
            for i, add in enumerate(prep.adds)
        ]
        await self.submit(prep.adds, choices, req.deadline, req.stream)

    def _chunk(self, choice: Choice, delta: dict, finish_reason: str | None = None) -> bytes:
        if self._chunks is None:
            self._chunks = ChatChunks(self.prep.id, self.prep.served.served_id, self.created)
        logprobs = None
        if self.prep.request.logprobs and choice.pending_logprobs:
            items, choice.pending_logprobs = choice.pending_logprobs, []
            logprobs = {
                "content": chat_logprobs(self.prep.served.tokenizer, items, self.prep.request.top_logprobs),
                "refusal": None,
            }
        return self._chunks.render(choice.index, delta, finish_reason, logprobs)

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
        if choice.splitter.mode == "reasoning" and not choice.forcing:
            choice.reasoning_tokens += 1
        events = choice.splitter.feed(choice.text.feed([token_id]))
        if self.prep.request.stream:
            await self._open(choice)
            out = b"".join(self._chunk(choice, d) for d in self._deltas(choice, events))
            if out:
                await self.write(out)

    async def on_take_back(self, choice: Choice, marker: dict) -> None:
        """The marker: a chunk whose delta carries ``taken_back`` (clients ignore unknown delta fields)."""
        if self.prep.request.stream:
            await self._open(choice)
            await self.write(self._chunk(choice, {"taken_back": marker}))

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
        if choice.taken_back:
            msg["taken_back"] = choice.taken_back
        if sp.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in sp.tool_calls
            ]
        return msg

    async def respond(self) -> None:
        req, prep = self.prep.request, self.prep
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
            await self.finish_json(self.whole_body("chat.completion", choices))
            return
        out = b""
        if req.include_usage:
            out += sse(chat_chunk(prep.id, prep.served.served_id, self.created, {}, usage=self.usage(), choices=False))
        await self.end(out + sse("[DONE]"))
