"""The text a decision's questions are read from: one input, a suffix per question.

Every question's prompt is the same conversation up to the question: an
optional system message (the input's system and developer messages), then a
user turn opening with ``Input:`` and the input written as text. The question
follows in the same turn, and the assistant turn is opened with ``Answer:``
(as /v1/decide does) so the next token is the answer itself. Only that
suffix differs between questions, so the engine computes the input once and
each later question claims its retained blocks.

Each question is read at that one next position through its options' first
tokens (``apps.api.decide.label_first_tokens``): a predicate through "yes" /
"no", a choice through its values, a score through its level labels. Options
whose own spellings share a first token ("New York", "New Delhi") cannot be
told apart there, so they are listed with letters A, B, ... and read through
the letters instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from apps.api.decide import label_first_tokens
from apps.core.errors import InvalidRequest

KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
PREDICATE = ["yes", "no"]
# How an answer that declines begins; a question is refused when these outweigh its options.
REFUSAL_LEADS = ("Sorry", "I'm sorry", "I cannot", "I can't", "Unfortunately", "As an AI")


@dataclass
class QuestionPrompt:
    """One question as the engine reads it: the suffix after the input, and the tokens that count."""

    kind: str  # predicate | choice | score
    name: str | None
    values: list  # what each option answers: True/False, a choice's value, a level's label
    tail: str  # the question's text after the input
    option_tokens: list[list[int]]  # per option, the next-position tokens that stand for it
    refusal_tokens: list[int]  # tokens that begin a refusal and stand for no option
    keyed: bool = False  # read through letters (options that share a first token)

    @property
    def token_ids(self) -> list[int]:
        return sorted({t for toks in self.option_tokens for t in toks} | set(self.refusal_tokens))


def _unsupported(param: str) -> InvalidRequest:
    return InvalidRequest(
        "This model reads text only; input_image parts are not supported.", param=param, code="unsupported"
    )


def parts_text(content: str | list[dict], param: str) -> str:
    """A string, or its parts as text (input_json as compact JSON); an image is refused."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        kind = part["type"]
        if kind == "input_image":
            raise _unsupported(f"{param}[{j}]")
        if kind == "input_json":
            out.append(json.dumps(part["data"], ensure_ascii=False, separators=(",", ":")))
        elif kind == "refusal":
            out.append(f"(refused) {part['refusal']}")
        else:
            out.append(part["text"])
    return "\n".join(out)


def input_text(value: str | list[dict]) -> tuple[str | None, str]:
    """(the system message or None, the input as text): a lone user message as its text, a
    conversation as one line per turn, tool call and tool output."""
    if isinstance(value, str):
        return None, value
    system, lines, names = [], [], {}
    for i, item in enumerate(value):
        kind, param = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            text = parts_text(item["content"], f"{param}.content")
            if item["role"] in ("system", "developer"):
                system.append(text)
            else:
                lines.append((item["role"], text))
        elif kind in ("function_call", "custom_tool_call"):
            names[item["call_id"]] = item["name"]
            args = item["arguments"] if kind == "function_call" else item["input"]
            lines.append(("call", f"Assistant called {item['name']}({args}) [call {item['call_id']}]"))
        else:
            text = parts_text(item["output"], f"{param}.output")
            name = names.get(item["call_id"], "the tool")
            lines.append(("output", f"Output of {name} [call {item['call_id']}]: {text}"))
    if len(lines) == 1 and lines[0][0] == "user":
        transcript = lines[0][1]
    else:
        transcript = "\n".join(f"{role.capitalize()}: {text}" if role in ("user", "assistant") else text
                               for role, text in lines)  # fmt: skip
    return ("\n\n".join(system) or None), transcript


def input_head(transcript: str) -> str:
    """The user turn's opening, shared by every question of the request."""
    return f"Input:\n{transcript}\n\n"


def option_text(value: str | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else value


def _options_block(texts: list[str], descriptions: list[str | None], keyed: bool, lead: str) -> str:
    if keyed:
        lines = [f"{KEYS[i]}. {t}" + (f": {d}" if d else "") for i, (t, d) in enumerate(zip(texts, descriptions))]
        return f"{lead}:\n" + "\n".join(lines) + "\nAnswer with the letter of one option only."
    if any(descriptions):
        lines = [f"- {t}" + (f": {d}" if d else "") for t, d in zip(texts, descriptions)]
        return f"{lead}:\n" + "\n".join(lines) + "\nAnswer with one option only."
    return f"{lead}: {', '.join(texts)}\nAnswer with one option only."


def _refusal_tokens(tokenizer, claimed: set[int]) -> list[int]:
    toks = set()
    for lead in REFUSAL_LEADS:
        for form in (lead, " " + lead):
            ids = tokenizer.encode(form)
            if ids and ids[0] not in claimed:
                toks.add(ids[0])
    return sorted(toks)


def question_prompt(tokenizer, question: dict, index: int) -> QuestionPrompt:
    """How question ``index`` is asked and read (``question`` as schema.decisions_parse left it)."""
    kind, param = question["type"], f"questions[{index}]"
    text = parts_text(question["instructions"], f"{param}.instructions")
    if kind == "predicate":
        values, texts, descriptions = [True, False], PREDICATE, [None, None]
    elif kind == "choice":
        values = [c["value"] for c in question["choices"]]
        texts, descriptions = [option_text(v) for v in values], [c.get("description") for c in question["choices"]]
    else:
        values = [level["label"] for level in question["levels"]]
        texts, descriptions = values, [level.get("description") for level in question["levels"]]
    try:
        option_tokens, keyed = label_first_tokens(tokenizer, texts), False
    except InvalidRequest:  # two options begin with the same token: read letters instead
        option_tokens, keyed = label_first_tokens(tokenizer, list(KEYS[: len(texts)])), True
    if kind == "predicate":
        tail = f"Statement: {text}\nIs the statement true? Answer yes or no."
    elif kind == "choice":
        tail = f"Question: {text}\n" + _options_block(texts, descriptions, keyed, "Options")
    else:
        tail = f"Question: {text}\n" + _options_block(texts, descriptions, keyed, "Options, from lowest to highest")
    claimed = {t for toks in option_tokens for t in toks}
    return QuestionPrompt(
        kind=kind,
        name=question.get("name"),
        values=values,
        tail=tail,
        option_tokens=option_tokens,
        refusal_tokens=_refusal_tokens(tokenizer, claimed),
        keyed=keyed,
    )
