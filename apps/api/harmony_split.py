"""Splitting gpt-oss's harmony output into reasoning, content and tool calls.

An assistant turn in OpenAI's harmony format is a run of messages, each a header
then a body: ``<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY``
closed by ``<|end|>`` (more messages follow), ``<|return|>`` (the turn is over)
or ``<|call|>`` (a tool call: the caller answers). The prompt ends with
``<|start|>assistant``, so generation begins inside the first header.

* channel ``analysis``: the body is reasoning (``reasoning_content``, the
  Responses API's reasoning items), as ``<think>`` text is for other models;
* a recipient ``functions.NAME`` (channel ``commentary``, the recipient in the
  header before or after the channel): the body is the call's JSON arguments,
  held to its end and sent as one ``tool_call_start`` / ``tool_call_args`` /
  ``tool_call`` group (arguments re-serialised when they parse, else verbatim);
* anything else (``final``, a ``commentary`` preamble to the user, a message to
  a built-in tool such as ``python``, which this server does not run): content.

The markers are special tokens, so the text must be decoded with them kept
(``OutputParsers.keep_special_tokens``). Like the tag splitter, text is emitted
as soon as it is certain, never the first characters of what may be a marker;
a header with a newline or past ``MAX_HEADER`` characters means the model is not
writing harmony at all, and the rest is content with any markers dropped.
"""

from __future__ import annotations

import json
import re

from apps.api.output_parsers import HARMONY, OutputParsers, ToolCall, new_call_id
from apps.api.output_split import Event, OutputSplitter, _partial_tag

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, "<|constrain|>")
BODY_ENDS = (END, RETURN, CALL, START)  # a <|start|> mid-body: the model skipped the <|end|>
MAX_HEADER = 256
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


class HarmonySplitter(OutputSplitter):
    """Feed text, get :class:`Event` s (the same interface and kinds as the tag splitter).

    ``mode``: "header" (reading a message header), "reasoning" / "content" / "tool" (a body),
    "between" (after a message, before the next ``<|start|>``), "plain" (not harmony after all).
    ``in_reasoning``: the prompt opened an analysis message itself.
    """

    def __init__(self, *, in_reasoning: bool = False, parse_tools: bool = True, parsers: OutputParsers = HARMONY):
        super().__init__(parse_tools=parse_tools, parsers=parsers)
        self.mode = "reasoning" if in_reasoning else "header"
        self._name: str | None = None  # the function a "tool" body calls
        self._messages = int(in_reasoning)  # messages opened so far

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """Consume what is certain in the buffer; True when the mode changed and there may be more."""
        if self.mode == "plain":
            self._emit_held(MARKERS, "content", events, drop=MARKERS)
            return False
        if self.mode == "header":
            i = self._buf.find(MESSAGE)
            if i < 0:
                if "\n" in self._buf or len(self._buf) > MAX_HEADER:
                    self.mode = "plain"
                    return True
                return False
            self._open(self._buf[:i])
            self._buf = self._buf[i + len(MESSAGE) :]
            return True
        if self.mode == "between":
            hits = [i for i in (self._buf.find(START), self._buf.find(CHANNEL)) if i >= 0]
            if not hits:
                self._buf = self._buf[len(self._buf) - _partial_tag(self._buf, (START, CHANNEL)) :]
                return False
            i = min(hits)
            skip = len(START) if self._buf.startswith(START, i) else 0
            self._buf, self.mode = self._buf[i + skip :], "header"
            return True
        hits = [(i, tag) for tag in BODY_ENDS if (i := self._buf.find(tag)) >= 0]
        if not hits:
            if self.mode != "tool":
                self._emit_held(BODY_ENDS, self.mode, events)
            return False
        i, tag = min(hits)
        body, self._buf = self._buf[:i], self._buf[i + (0 if tag == START else len(tag)) :]
        if self.mode == "tool":
            self._call_done(body, events)
        else:
            self._emit(self.mode, body, events)
        self.mode = "between"
        return True

    def _open(self, header: str) -> None:
        """Start the body of the message ``header`` describes."""
        self._messages += 1
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1) if recipient else ""
        if self.parse_tools and name.startswith("functions.") and len(name) > len("functions."):
            self.mode, self._name = "tool", name[len("functions.") :]
        elif channel is not None and channel.group(1) == "analysis":
            self.mode = "reasoning"
        else:
            self.mode = "content"

    def _emit_held(self, tags: tuple[str, ...], kind: str, events: list[Event], drop: tuple[str, ...] = ()) -> None:
        """Emit the buffer as ``kind`` but for what may begin one of ``tags`` (kept); ``drop`` markers vanish."""
        keep = _partial_tag(self._buf, tags)
        shown = self._buf[: len(self._buf) - keep]
        for marker in drop:
            shown = shown.replace(marker, "")
        self._emit(kind, shown, events)
        self._buf = self._buf[len(self._buf) - keep :]

    def _call_done(self, body: str, events: list[Event], *, closed: bool = True) -> None:
        args = body.strip()
        try:
            args = json.dumps(json.loads(args), ensure_ascii=False)
        except ValueError:
            if not closed:  # cut short (max_tokens) before the arguments were whole: no call
                return
        call = ToolCall(index=len(self.tool_calls), id=new_call_id(), name=self._name or "", arguments=args)
        self.tool_calls.append(call)
        events += [
            Event("tool_call_start", call=call),
            Event("tool_call_args", args, call),
            Event("tool_call", call=call),
        ]

    def flush(self) -> list[Event]:
        """The end of generation: a body cut short is what it is; a header cut short is dropped."""
        events: list[Event] = []
        buf, self._buf = self._buf, ""
        if self.mode == "tool":
            self._call_done(buf, events, closed=False)
        elif self.mode in ("reasoning", "content", "plain"):
            cut = _partial_tag(buf, MARKERS)
            buf = buf[: len(buf) - cut]
            for marker in MARKERS if self.mode == "plain" else ():
                buf = buf.replace(marker, "")
            self._emit(self.mode if self.mode != "plain" else "content", buf, events)
        elif self.mode == "header" and not self._messages and "<|" not in buf:
            self._emit("content", buf, events)  # a short answer with no harmony at all
        self.mode = "between"
        return events


def splitter_for(*, in_reasoning: bool = False, parse_tools: bool = True, parsers: OutputParsers) -> OutputSplitter:
    """The splitter a model's output needs: the harmony reader for harmony models (channels,
    not tags), the tag splitter otherwise."""
    cls = HarmonySplitter if parsers.harmony else OutputSplitter
    return cls(in_reasoning=in_reasoning, parse_tools=parse_tools, parsers=parsers)
