"""Splitting generated text into channels: reasoning, content and tool calls.

The model writes one stream of text. Text between ``<think>`` and ``</think>``
is reasoning (``reasoning_content``); ``<tool_call>{"name": ..., "arguments":
...}</tool_call>`` blocks (the Hermes / Qwen format) are tool calls; the rest
is content. :class:`ChannelSplitter` is fed text as it is detokenized and
returns events as soon as they are certain: it never emits the first
characters of what may turn out to be a tag.

A tool call streams: once its ``name`` is read and its ``"arguments": {``
begins, a ``tool_call_start`` event carries the name, then ``tool_call_args``
events carry the arguments as they arrive, re-serialised the way
``json.dumps(json.loads(...), ensure_ascii=False)`` writes them (:class:`JsonEcho`),
so the pieces add up to the same text a whole parse gives; ``tool_call`` ends
it. A call whose body is not that shape (arguments first, arguments a string)
is held to its closing tag and sent as the same three events at once; one that
never parses is shown as text. A call already started stays a call: cut short
(max_tokens, a deadline) it keeps the arguments streamed so far.

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
    kind: str  # "reasoning" | "content" | "tool_call_start" | "tool_call_args" | "tool_call" (the call is complete)
    text: str = ""  # reasoning / content text; for tool_call_args the arguments' next piece
    call: ToolCall | None = None


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SCALAR = frozenset("0123456789+-.eEabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def dump_chars(text: str) -> str:
    """``text`` escaped as json.dumps(ensure_ascii=False) writes it inside a string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class JsonEcho:
    """A JSON text read as it arrives, as tokens ``(kind, text, depth)`` whose texts, joined (``str_text``
    through :func:`dump_chars`), are what ``json.dumps(json.loads(text), ensure_ascii=False)`` writes:
    whitespace dropped, ``", "`` and ``": "`` separators, strings decoded (``str_text`` is decoded text),
    numbers and literals normalised once their last character is known. ``depth`` is the nesting level
    the token sits at (the outermost ``{`` and ``}`` are 0, the keys inside 1). Only tokens are checked,
    not the grammar; ``bad`` says a character could not be a JSON token (nothing more is read)."""

    def __init__(self) -> None:
        self.depth = 0
        self.bad = False
        self._str = False
        self._esc: str | None = None  # after a backslash: the escape so far
        self._high = ""  # a high surrogate (\\uD800-\\uDBFF) waiting for its low half
        self._scalar = ""

    def feed(self, text: str) -> list[tuple[str, str, int]]:
        toks: list[tuple[str, str, int]] = []
        for ch in text:
            if self.bad:
                break
            self._char(ch, toks)
        return toks

    def _text(self, c: str, toks: list) -> None:
        code = ord(c)
        if self._high and 0xDC00 <= code < 0xE000:
            c = chr(0x10000 + ((ord(self._high) - 0xD800) << 10) + (code - 0xDC00))
            self._high = ""
        elif self._high:
            toks.append(("str_text", self._high, self.depth))
            self._high = ""
        if 0xD800 <= ord(c) < 0xDC00:
            self._high = c
            return
        toks.append(("str_text", c, self.depth))

    def _char(self, ch: str, toks: list) -> None:
        if self._str:
            if self._esc is not None:
                self._esc += ch
                esc = self._esc
                if esc[0] == "u":
                    if ch not in "0123456789abcdefABCDEF" and len(esc) > 1:
                        self.bad = True
                    elif len(esc) == 5:
                        self._esc = None
                        self._text(chr(int(esc[1:], 16)), toks)
                    return
                self._esc = None
                if esc not in _ESCAPES:
                    self.bad = True
                    return
                self._text(_ESCAPES[esc], toks)
            elif ch == "\\":
                self._esc = ""
            elif ch == '"':
                if self._high:
                    toks.append(("str_text", self._high, self.depth))
                    self._high = ""
                self._str = False
                toks.append(("str_close", '"', self.depth))
            elif ord(ch) < 0x20:
                self.bad = True
            else:
                self._text(ch, toks)
            return
        if ch in _SCALAR:
            self._scalar += ch
            return
        if self._scalar:
            try:
                value = json.loads(self._scalar)
            except ValueError:
                self.bad = True
                return
            self._scalar = ""
            toks.append(("scalar", json.dumps(value), self.depth))
        if ch in " \t\n\r":
            return
        if ch == '"':
            self._str = True
            toks.append(("str_open", '"', self.depth))
        elif ch in "{[":
            toks.append(("open", ch, self.depth))
            self.depth += 1
        elif ch in "}]" and self.depth > 0:
            self.depth -= 1
            toks.append(("close", ch, self.depth))
        elif ch == ",":
            toks.append(("comma", ", ", self.depth))
        elif ch == ":":
            toks.append(("colon", ": ", self.depth))
        else:
            self.bad = True


class _CallStream:
    """One ``<tool_call>`` body being read: its name, then its arguments as they come."""

    def __init__(self) -> None:
        self.echo = JsonEcho()
        self.fed = 0  # characters of the body fed to the echo
        self.expect = ""  # at depth 1: "key" | "value" | "" (inside a value)
        self.key = self.name = None
        self.reading: str | None = None  # "key" | "name": a depth-1 string being collected
        self.buf = ""
        self.call: ToolCall | None = None  # set once started
        self.in_args = False

    def feed(self, text: str, index: int) -> list[Event]:
        """Events for ``text``, the body's next characters."""
        events: list[Event] = []
        for kind, text_, depth in self.echo.feed(text):
            if self.in_args:
                piece = dump_chars(text_) if kind == "str_text" else text_
                self.call.arguments += piece
                if events and events[-1].kind == "tool_call_args":
                    events[-1].text += piece
                else:
                    events.append(Event("tool_call_args", piece, self.call))
                if kind == "close" and depth == 1:
                    self.in_args = False
                continue
            if depth == 0:
                if kind == "open" and text_ == "{" and self.key is None:
                    self.expect = "key"
                continue
            if depth > 1:
                continue
            if kind == "str_text" and self.reading:
                self.buf += text_
            elif kind == "str_close" and self.reading:
                if self.reading == "key":
                    self.key = self.buf
                else:
                    self.name = self.buf
                self.reading = None
            elif kind == "colon":
                self.expect = "value"
            elif kind == "comma":
                self.expect = "key"
            elif self.expect == "key" and kind == "str_open":
                self.reading, self.buf, self.expect = "key", "", ""
            elif self.expect == "value":
                self.expect = ""
                if kind == "str_open" and self.key == "name":
                    self.reading, self.buf = "name", ""
                elif kind == "open" and text_ == "{" and self.key == "arguments" and self.name and self.call is None:
                    self.call = ToolCall(index=index, id=new_call_id(), name=self.name, arguments="{")
                    self.in_args = True
                    events += [Event("tool_call_start", call=self.call), Event("tool_call_args", "{", self.call)]
        return events


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
        self._call: _CallStream | None = None  # the tool call being read
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
                    self._stream_call(len(self._buf) - _partial_tag(self._buf, (TOOL_CLOSE,)), events)
                    return events
                self._stream_call(end, events)
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
            if self.mode == "tool":
                self._call = _CallStream()

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

    def _stream_call(self, upto: int, events: list[Event]) -> None:
        """Feed the call's body up to ``upto`` (held back: what may be the start of ``</tool_call>``)."""
        cs = self._call
        if cs is None or upto <= cs.fed:
            return
        new = cs.feed(self._buf[cs.fed : upto], len(self.tool_calls))
        cs.fed = upto
        if new and new[0].kind == "tool_call_start":
            self.tool_calls.append(new[0].call)
        events += new

    def _tool_done(self, body: str, events: list[Event], *, closed: bool) -> None:
        cs, self._call = self._call, None
        started = cs.call if cs is not None else None
        if started is not None:  # streamed: the rest of the arguments, if the whole parse has more
            whole = parse_tool_call(body.strip(), started.index)
            if whole is not None and whole.arguments.startswith(started.arguments):
                rest = whole.arguments[len(started.arguments) :]
                if rest:
                    started.arguments = whole.arguments
                    events.append(Event("tool_call_args", rest, started))
            events.append(Event("tool_call", call=started))
            return
        call = parse_tool_call(body.strip(), len(self.tool_calls))
        if call is None:  # not a call after all: show the model's text as it was
            self._emit("content", TOOL_OPEN + body + (TOOL_CLOSE if closed else ""), events)
            return
        self.tool_calls.append(call)
        events += [
            Event("tool_call_start", call=call),
            Event("tool_call_args", call.arguments, call),
            Event("tool_call", call=call),
        ]

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
