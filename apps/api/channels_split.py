"""Splitting generated text into channels: reasoning, content and tool calls.

The model writes one stream of text. Text between ``<think>`` and ``</think>``
is reasoning (``reasoning_content``); ``<tool_call>{"name": ..., "arguments":
...}</tool_call>`` blocks (the Hermes / Qwen format) are tool calls; the rest
is content. :class:`ChannelSplitter` is fed text as it is detokenized and
returns events as soon as they are certain: it never emits the first
characters of what may turn out to be a tag, and it holds a tool call until
its closing tag so the call is emitted whole (name, then arguments).

Shared by chat completions and the Responses API; nothing here knows about
HTTP or the engine.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON text, as the OpenAI API carries it


@dataclass
class Event:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_call(body: str, index: int) -> ToolCall | None:
    """A Hermes tool call body (``{"name": ..., "arguments": {...}}``), or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(index=index, id=new_call_id(), name=value["name"], arguments=args)


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ChannelSplitter:
    """Feed text, get :class:`Event` s. ``in_reasoning``: the prompt already opened ``<think>``."""

    def __init__(self, *, in_reasoning: bool = False, parse_tools: bool = True):
        self.mode = "reasoning" if in_reasoning else "content"
        self.parse_tools = parse_tools
        self._buf = ""
        self._strip_ws = False  # after a closing tag, whitespace before the content is layout
        self.tool_calls: list[ToolCall] = []
        self.reasoning = ""
        self.content = ""

    def _opening_tags(self) -> tuple[str, ...]:
        return (THINK_OPEN, TOOL_OPEN) if self.parse_tools else (THINK_OPEN,)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self.mode == "tool":
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CLOSE) :]
                self._tool_done(body, events, closed=True)
                self.mode, self._strip_ws = "content", True
                continue
            if self.mode == "reasoning":
                end = self._buf.find(THINK_CLOSE)
                if end < 0:
                    keep = _partial_tag(self._buf, (THINK_CLOSE,))
                    self._emit("reasoning", self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                self._emit("reasoning", self._buf[:end], events)
                self._buf = self._buf[end + len(THINK_CLOSE) :]
                self.mode, self._strip_ws = "content", True
                continue
            if self._strip_ws:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return events
                self._strip_ws = False
            hits = [(i, tag) for tag in self._opening_tags() if (i := self._buf.find(tag)) >= 0]
            if not hits:
                keep = _partial_tag(self._buf, self._opening_tags())
                self._emit("content", self._buf[: len(self._buf) - keep], events)
                self._buf = self._buf[len(self._buf) - keep :]
                return events
            i, tag = min(hits)
            self._emit("content", self._buf[:i], events)
            self._buf = self._buf[i + len(tag) :]
            self.mode = "reasoning" if tag == THINK_OPEN else "tool"

    def flush(self) -> list[Event]:
        """The end of generation: whatever is held is what it is (an unclosed call still counts if it parses)."""
        events: list[Event] = []
        buf, self._buf = self._buf, ""
        if self.mode == "tool":
            self._tool_done(buf, events, closed=False)
        elif self.mode == "reasoning":
            self._emit("reasoning", buf, events)
        elif not self._strip_ws or buf.strip():
            self._emit("content", buf.lstrip() if self._strip_ws else buf, events)
        self.mode = "content"
        return events

    def _tool_done(self, body: str, events: list[Event], *, closed: bool) -> None:
        call = parse_tool_call(body.strip(), len(self.tool_calls))
        if call is None:  # not a call after all: show the model's text as it was
            self._emit("content", TOOL_OPEN + body + (TOOL_CLOSE if closed else ""), events)
            return
        self.tool_calls.append(call)
        events.append(Event("tool_call", call=call))

    def _emit(self, kind: str, text: str, events: list[Event]) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if events and events[-1].kind == kind:
            events[-1].text += text
        else:
            events.append(Event(kind, text))
