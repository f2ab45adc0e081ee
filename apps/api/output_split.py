"""Splitting generated text into its parts: reasoning, content and tool calls.

The model writes one stream of text. Text between the reasoning tags (``<think>``
and ``</think>`` by default) is reasoning (``reasoning_content``); tool call blocks
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the Hermes / Qwen
format) are tool calls; the rest is content. The tags come from the model's
parsers (output_parsers.py). :class:`OutputSplitter` is fed text as it is detokenized and
returns events as soon as they are certain: it never emits the first
characters of what may turn out to be a tag.

A tool call streams: once its ``name`` is read and its ``"arguments": {``
begins, a ``tool_call_start`` event carries the name, then ``tool_call_args``
events carry the arguments as they arrive, re-serialised the way
``json.dumps(json.loads(...), ensure_ascii=False)`` writes them (:class:`JsonEcho`),
so the pieces add up to the same text a whole parse gives; ``tool_call`` ends
it. A call whose body is not that shape (arguments first, arguments a string)
is held to its closing tag and sent as the same three events at once; a closed
one that never parses is shown as text. A call already started stays a call: cut
short (max_tokens, a deadline) it keeps the arguments streamed so far; one cut
before it started (no name yet) is dropped, never shown as a raw tag.

Shared by chat completions and the Responses API; nothing here knows about
HTTP or the engine. A model writing harmony messages (gpt-oss) gets
``harmony_split.HarmonySplitter`` instead: ``harmony_split.splitter_for`` picks by the
model's parsers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from apps.api.output_parsers import DEFAULT, OutputParsers, ToolCall, new_call_id


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
    """One tool call body being read: its name, then its arguments as they come."""

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


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class OutputSplitter:
    """Feed text, get :class:`Event` s. ``in_reasoning``: the prompt already opened the reasoning."""

    def __init__(self, *, in_reasoning: bool = False, parse_tools: bool = True, parsers: OutputParsers = DEFAULT):
        self.parsers = parsers
        self.think_open, self.think_close = parsers.reasoning.start, parsers.reasoning.end
        self.tool_open, self.tool_close = parsers.tools.start, parsers.tools.end
        self.mode = "reasoning" if in_reasoning else "content"
        self.parse_tools = parse_tools
        self._buf = ""
        self._strip_ws = False  # after a closing tag, whitespace before the content is layout
        self.tool_calls: list[ToolCall] = []
        self._call: _CallStream | None = None  # the tool call being read
        self.reasoning = ""
        self.content = ""

    def _opening_tags(self) -> tuple[str, ...]:
        return (self.think_open, self.tool_open) if self.parse_tools else (self.think_open,)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self.mode == "tool":
                end = self._buf.find(self.tool_close)
                if end < 0:
                    self._stream_call(len(self._buf) - _partial_tag(self._buf, (self.tool_close,)), events)
                    return events
                self._stream_call(end, events)
                body, self._buf = self._buf[:end], self._buf[end + len(self.tool_close) :]
                self._tool_done(body, events, closed=True)
                self.mode, self._strip_ws = "content", True
                continue
            if self.mode == "reasoning":
                end = self._buf.find(self.think_close)
                if end < 0:
                    keep = _partial_tag(self._buf, (self.think_close,))
                    self._emit("reasoning", self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                self._emit("reasoning", self._buf[:end], events)
                self._buf = self._buf[end + len(self.think_close) :]
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
            self.mode = "reasoning" if tag == self.think_open else "tool"
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
            text = buf.lstrip() if self._strip_ws else buf
            if self.parse_tools and (cut := _partial_tag(text, (self.tool_open,))):
                text = text[:-cut]  # a tool call's opening tag cut short (max_tokens): never shown
            self._emit("content", text, events)
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
            whole = self.parsers.tools.parse(body.strip(), started.index)
            if whole is not None and whole.arguments.startswith(started.arguments):
                rest = whole.arguments[len(started.arguments) :]
                if rest:
                    started.arguments = whole.arguments
                    events.append(Event("tool_call_args", rest, started))
            events.append(Event("tool_call", call=started))
            return
        call = self.parsers.tools.parse(body.strip(), len(self.tool_calls))
        if call is None and not closed:  # cut before it could parse (max_tokens, a deadline): no raw tag
            return
        if call is None:  # closed but not a call after all: show the model's text as it was
            self._emit("content", self.tool_open + body + self.tool_close, events)
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
