"""Which tags a model writes around its reasoning and its tool calls, by model family.

A ``ReasoningParser`` names the tags around reasoning (``<think>`` ... ``</think>``)
and a ``ToolParser`` those around a tool call and how its body reads (the Hermes
JSON ``{"name": ..., "arguments": {...}}``). ``output_parsers_for`` picks a
family's pair from the model's chat template: the first family whose tags the
template writes, else ``DEFAULT`` (the Hermes / Qwen tags). The splitter
(output_split.py) reads only these, so a family with other tags is one entry in
``FAMILIES``.

gpt-oss writes no tags but OpenAI's *harmony* messages
(``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``),
whose markers are special tokens: ``HARMONY`` is chosen when the template or the
tokenizer's special tokens carry ``<|channel|>``; its splitter is
``harmony_split.HarmonySplitter`` and its text must be decoded with the special
tokens kept (``keep_special_tokens``).
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON text, as the OpenAI API carries it


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ReasoningParser:
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt: str) -> bool:
        """The prompt itself opened the reasoning (the template ends with the start tag)."""
        return prompt.rstrip().endswith(self.start)


@dataclass(frozen=True)
class ToolParser:
    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def parse(self, body: str, index: int) -> ToolCall | None:
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


@dataclass(frozen=True)
class OutputParsers:
    family: str
    reasoning: ReasoningParser
    tools: ToolParser
    harmony: bool = False  # messages on channels (gpt-oss), not tags: harmony_split.HarmonySplitter

    @property
    def keep_special_tokens(self) -> bool:
        """Decode generated ids with special tokens kept: harmony's markers are special tokens."""
        return self.harmony


DEFAULT = OutputParsers("hermes", ReasoningParser(), ToolParser())
HARMONY_CHANNEL = "<|channel|>"
# The reasoning tags are what a prompt ends with when it opens the analysis message itself.
HARMONY = OutputParsers(
    "harmony",
    ReasoningParser(start="<|channel|>analysis<|message|>", end="<|end|>"),
    ToolParser(start=" to=functions.", end="<|call|>"),
    harmony=True,
)
# Checked in order before the default; a family is chosen when its template writes its tool tag.
FAMILIES: dict[str, OutputParsers] = {DEFAULT.family: DEFAULT}


def output_parsers_for(tokenizer) -> OutputParsers:
    """The parsers for the model behind ``tokenizer`` (chosen from its chat template and special tokens)."""
    if HARMONY_CHANNEL in (getattr(tokenizer, "special_tokens", None) or ()):
        return HARMONY
    return _for_template(getattr(tokenizer, "chat_template", None) or "")


@functools.lru_cache(maxsize=32)
def _for_template(template: str) -> OutputParsers:
    if HARMONY_CHANNEL in template:
        return HARMONY
    for parsers in FAMILIES.values():
        if parsers is not DEFAULT and parsers.tools.start in template:
            return parsers
    return DEFAULT


def parse_tool_call(body: str, index: int) -> ToolCall | None:
    """A tool call body in the default (Hermes) format, or None."""
    return DEFAULT.tools.parse(body, index)
