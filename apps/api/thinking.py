"""``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) as the model's thinking switch.

A chat template with an ``enable_thinking`` variable (Qwen3 and its kind) has one:
``none`` and ``minimal`` render it false, ``low`` and above true (an explicit
``chat_template_kwargs.enable_thinking`` wins). A template without it has no
switch: ``none`` and ``minimal`` are honoured as they are (the model does not
reason), and asking for reasoning it cannot turn on is a 400 ``unsupported``.
A template reading ``reasoning_effort`` itself (gpt-oss) gets the effort as
its ``reasoning_effort`` (``none`` / ``minimal`` as ``low``, its lowest).
"""

from __future__ import annotations

from apps.core.errors import InvalidRequest

SWITCH = "enable_thinking"
EFFORT = "reasoning_effort"  # a template that takes the effort as it is (gpt-oss's harmony)
OFF = ("none", "minimal")


def thinking_kwargs(template_kwargs: dict | None, effort: str | None, template: str | None, *, param: str) -> dict:
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
    elif effort not in OFF:
        raise InvalidRequest(
            f"This model's chat template has no thinking switch ({SWITCH}), so {param} {effort!r} cannot be "
            f"honoured; leave it out or use 'none'.",
            param=param,
            code="unsupported",
        )
    return kwargs
