"""Responses API output: generated text split into items, and the events that build them.

The chat side's ``OutputSplitter`` (output_split.py) turns the text of a
generation into reasoning, content and tool calls, never acting on half a
tag; ``ResponseEvents`` turns those pieces into the
Responses API's output items and its stream events, in the order the
official SDK's accumulator (``ResponseStreamState``) checks:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta...,
                 response.output_text.done, response.content_part.done
      reasoning: response.reasoning_text.delta..., response.reasoning_text.done
      function:  response.function_call_arguments.delta, ...arguments.done
    response.output_item.done,
    response.completed | response.incomplete | response.failed

Every event carries ``sequence_number`` (0, 1, 2 ... per response). The same
builder serves non-streamed requests: the events are dropped and
``response`` is the answer.
"""

from __future__ import annotations

import json
import time
import uuid

from apps.api.harmony_split import splitter_for
from apps.api.output_parsers import DEFAULT, OutputParsers, output_parsers_for
from apps.api.usage import usage_object


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvents:
    """One response's output items and stream events, built from split text."""

    def __init__(self, response: dict, *, tools: bool, in_reasoning: bool = False, parsers: OutputParsers = DEFAULT):
        self.response = response  # the Response object; ``output`` fills as items close
        self.splitter = splitter_for(in_reasoning=in_reasoning, parse_tools=tools, parsers=parsers)
        self.seq = 0
        self.open: dict | None = None  # the item receiving deltas (reasoning or message)
        self.call: dict | None = None  # the function_call item receiving argument deltas
        self.reasoning_tokens = 0
        self.taken_back_tokens = 0  # from RequestFinished (extension: output_tokens_details)

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    def start(self) -> list[dict]:
        self.response["status"] = "in_progress"
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def feed(self, text: str, num_tokens: int = 0) -> list[dict]:
        if self.splitter.mode == "reasoning":
            self.reasoning_tokens += num_tokens
        events: list[dict] = []
        for ev in self.splitter.feed(text):
            events += self._piece(ev)
        return events

    def take_back(self, marker: dict) -> list[dict]:
        """A take-back (docs/API.md, Loop guard and thinking budget): recorded on the reasoning item
        as ``taken_back`` and streamed as an empty reasoning delta carrying it (the SDK's
        accumulator appends ``""`` and keeps unknown fields)."""
        events = self._close() if self.open is not None and self.open["type"] != "reasoning" else []
        if self.open is None:
            events += self._open_reasoning()
        item = self.open
        item.setdefault("taken_back", []).append(marker)
        return events + [
            self._event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                delta="",
                taken_back=marker,
            )
        ]

    # -- items ---------------------------------------------------------------

    @property
    def _index(self) -> int:
        return len(self.response["output"])

    def _piece(self, ev) -> list[dict]:
        """One splitter event (output_split.Event) as item events."""
        if ev.kind == "tool_call_start":
            return self._close() + self._function_call_start(ev.call.name, ev.call.id)
        if ev.kind == "tool_call_args":
            return self._function_call_args(ev.text)
        if ev.kind == "tool_call":
            return self._function_call_done()
        kind, piece = ev.kind, ev.text
        if kind == "content" and (self.open is None or self.open["type"] != "message"):
            if self.response["output"] or (self.open is not None):
                piece = piece.lstrip()  # the newline after </think> or a tool call opens no message
            if not piece:
                return []
        events: list[dict] = []
        want = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != want:
            events += self._close()
            events += self._open_reasoning() if want == "reasoning" else self._open_message()
        item = self.open
        if want == "reasoning":
            item["content"][0]["text"] += piece
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=self._index,
                    content_index=0,
                    delta=piece,
                )
            )
        else:
            item["content"][0]["text"] += piece
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=self._index,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
            )
        return events

    def _open_message(self) -> list[dict]:
        self.open = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        added = self._event(
            "response.output_item.added", output_index=self._index, item=json.loads(json.dumps(self.open))
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open["content"].append(part)
        return [
            added,
            self._event(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=self._index,
                content_index=0,
                part=dict(part, annotations=[]),
            ),
        ]

    def _open_reasoning(self) -> list[dict]:
        self.open = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        added = self._event(
            "response.output_item.added", output_index=self._index, item=json.loads(json.dumps(self.open))
        )
        self.open["content"].append({"type": "reasoning_text", "text": ""})
        return [added]

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx, text = self._index, item["content"][0]["text"]
        item["status"] = status
        if item["type"] == "reasoning":
            events = [
                self._event(
                    "response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text
                )
            ]
        else:
            events = [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=dict(item["content"][0]),
                ),
            ]
        self.response["output"].append(item)
        return events + [self._event("response.output_item.done", output_index=idx, item=json.loads(json.dumps(item)))]

    def _function_call_start(self, name: str, call_id: str) -> list[dict]:
        self.call = {
            "id": new_id("fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        return [self._event("response.output_item.added", output_index=self._index, item=dict(self.call))]

    def _function_call_args(self, delta: str) -> list[dict]:
        item = self.call
        item["arguments"] += delta
        return [
            self._event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=self._index, delta=delta
            )
        ]

    def _function_call_done(self, status: str = "completed") -> list[dict]:
        item, self.call = self.call, None
        if item is None:
            return []
        idx = self._index
        item["status"] = status
        events = [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=idx,
                name=item["name"],
                arguments=item["arguments"],
            )
        ]
        self.response["output"].append(item)
        events.append(self._event("response.output_item.done", output_index=idx, item=dict(item)))
        return events

    # -- the end -------------------------------------------------------------

    def finish(self, usage: dict, *, incomplete_reason: str | None = None) -> list[dict]:
        """Close what is open; response.completed, or response.incomplete when cut (max_output_tokens)."""
        events: list[dict] = []
        for ev in self.splitter.flush():
            events += self._piece(ev)
        events += self._close("incomplete" if incomplete_reason else "completed")
        usage["output_tokens_details"]["reasoning_tokens"] = self.reasoning_tokens
        if self.taken_back_tokens:  # extension: counted in output_tokens
            usage["output_tokens_details"]["taken_back_tokens"] = self.taken_back_tokens
        self.response.update(usage=usage, completed_at=int(time.time()))
        if incomplete_reason:
            self.response.update(status="incomplete", incomplete_details={"reason": incomplete_reason})
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self.response["status"] = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]

    def fail(self, code: str, message: str) -> list[dict]:
        """The engine failed mid-response: response.failed, with what was produced so far."""
        events = self._close("incomplete") + self._function_call_done("incomplete")
        self.response.update(status="failed", error={"code": code, "message": message})
        return events + [self._event("response.failed", response=self._snapshot())]

    def output_messages(self) -> list[dict]:
        """This response's output as chat messages, for the next turn's prompt (reasoning dropped)."""
        text = "".join(i["content"][0]["text"] for i in self.response["output"] if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.response["output"]
            if i["type"] == "function_call"
        ]
        if not text and not calls:
            return []
        msg: dict = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg]


def output_text(response: dict) -> str:
    return "".join(
        p["text"]
        for i in response["output"]
        if i["type"] == "message"
        for p in i["content"]
        if p["type"] == "output_text"
    )


class ResponseRun:
    """One response in flight: engine messages in, stream events out."""

    def __init__(self, prep):
        from apps.api.streaming import TextStream

        self.prep = prep
        req = prep.request
        parsers = output_parsers_for(prep.served.tokenizer)
        self.events = ResponseEvents(
            json.loads(json.dumps(prep.base)),
            tools=req.tool_choice != "none",
            in_reasoning=prep.in_reasoning,
            parsers=parsers,
        )
        self.text = TextStream(
            prep.served.tokenizer, [], prep.add.prompt_token_ids, skip_special_tokens=not parsers.keep_special_tokens
        )
        self.cached_tokens = 0
        self.num_tokens = 0
        self.done = False

    @property
    def request_id(self) -> str:
        return self.prep.add.request_id

    @property
    def response(self) -> dict:
        return self.events.response

    def start(self) -> list[dict]:
        return self.events.start()

    def tokens(self, msg: dict) -> list[dict]:
        """A round's tokens, one at a time (a round may commit several; deltas stay per token)."""
        self.cached_tokens = msg.get("cached_tokens", self.cached_tokens)
        events: list[dict] = []
        if msg.get("taken_back_reason"):
            events += self.events.take_back({"tokens": msg.get("taken_back", 0), "reason": msg["taken_back_reason"]})
        forced = bool(msg.get("taken_back_reason"))  # the end of thinking a take-back forced: not reasoning
        for token_id in msg["token_ids"]:
            self.num_tokens += 1
            events += self.events.feed(self.text.feed([token_id]), 0 if forced else 1)
        return events

    def finished(self, msg: dict) -> list[dict]:
        """The engine's RequestFinished (or, cut by the deadline, one made up like it)."""
        self.done = True
        events = self.events.feed(self.text.flush())
        self.events.taken_back_tokens = msg.get("taken_back_tokens", 0)
        usage = usage_object(msg["prompt_tokens"], msg["completion_tokens"], msg.get("cached_tokens", 0))
        reason = msg["finish_reason"]
        cut = {"length": "max_output_tokens", "deadline": "deadline"}.get(reason) if msg["completion_tokens"] else None
        return events + self.events.finish(usage, incomplete_reason=cut)

    def failed(self, code: str, message: str) -> list[dict]:
        self.done = True
        return self.events.fail(code, message)

    def stored_messages(self) -> list[dict]:
        return self.prep.conversation + self.events.output_messages()
