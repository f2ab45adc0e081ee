"""``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) as the model's thinking switch.

A chat template with an ``enable_thinking`` variable (Qwen3 and its kind) has one:
``none`` and ``minimal`` render it false, ``low`` and above true (an explicit
``chat_template_kwargs.enable_thinking`` wins). A template without it has no
switch: ``none`` and ``minimal`` are honoured as they are (the model does not
reason), and asking for reasoning it cannot turn on is a 400 ``unsupported``,
unless the template writes the reasoning's start tag itself (``reasons``: it
always thinks), where the effort is a thinking budget only.
A template reading ``reasoning_effort`` itself (gpt-oss) gets the effort as
its ``reasoning_effort`` (``none`` / ``minimal`` as ``low``, its lowest; their
budget of 0 then closes the reasoning before it starts).

Every effort also stands for a thinking budget (``EFFORT_BUDGET``, unless the
request gives ``max_reasoning_tokens``), enforced by the engine's take-back
(engine/spec/reasoning.py; docs/API.md, Loop guard and thinking budget).
"""

from __future__ import annotations

from apps.core.errors import InvalidRequest

SWITCH = "enable_thinking"
EFFORT = "reasoning_effort"  # a template that takes the effort as it is (gpt-oss's harmony)
OFF = ("none", "minimal")


def thinking_kwargs(
    template_kwargs: dict | None, effort: str | None, template: str | None, *, param: str, reasons: bool = False
) -> dict:
    """The template variables to render with, the effort mapped onto the thinking switch."""
    kwargs = dict(template_kwargs or {})
    if template and EFFORT in template:  # gpt-oss (harmony) reads the effort itself; its lowest is "low"
        if effort is not None:
            kwargs.setdefault(EFFORT, "low" if effort in OFF else effort)
        return kwargs
    if effort is None or SWITCH in kwargs:
        return kwargs
    if template and SWITCH in template:
        kwargs[SWITCH] = effort not in OFF
    elif effort not in OFF and not reasons:
        raise InvalidRequest(
            f"This model's chat template has no thinking switch ({SWITCH}), so {param} {effort!r} cannot be "
            f"honoured; leave it out or use 'none'.",
            param=param,
            code="unsupported",
        )
    return kwargs


# The thinking budget an effort stands for when no max_reasoning_tokens is given (docs/API.md,
# Loop guard and thinking budget); None: no budget. none / minimal: no thinking at all (a template
# without a switch that reasons anyway is closed before its first reasoning token).
EFFORT_BUDGET = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384, "xhigh": None}
# What a family's template writes after the end of the thinking, forced with the end tag.
AFTER_END = {"harmony": "<|start|>assistant<|channel|>final<|message|>"}


def reasoning_budget(max_reasoning_tokens: int | None, effort: str | None) -> int | None:
    """The budget: the explicit one, else the effort's, else none."""
    if max_reasoning_tokens is not None:
        return max_reasoning_tokens
    return EFFORT_BUDGET.get(effort) if effort is not None else None


def reasoning_watch(tokenizer, parsers, *, opened: bool, budget: int | None) -> dict:
    """``AddRequest.reasoning``: the tags as token ids (the end tag also as the model writes it after a
    space), the forced end of the thinking, whether the prompt opened it, the budget."""
    start, end = parsers.reasoning.start, parsers.reasoning.end
    close = end + AFTER_END.get(parsers.family, "\n\n")

    def variants(tag: str) -> list[list[int]]:
        ids = [tokenizer.encode(tag)]
        spaced = tokenizer.encode(" " + tag)
        if spaced != [*tokenizer.encode(" "), *ids[0]]:  # " </think>" merges the space into the tag
            ids.append(spaced)
        return ids

    return {
        "start_ids": variants(start),
        "end_ids": variants(end),
        "close_ids": tokenizer.encode(close),
        "open": opened,
        "max_tokens": budget,
        "guard": True,
    }
