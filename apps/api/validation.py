"""Parsing request bodies into typed requests, refusing bad input with the param named."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from apps.api.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 2048
MAX_MESSAGE_CHARS = 1 << 20  # one message's text; the context bounds the sum
MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_N = 8  # choices per request: each is a sequence holding a decode lane


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a finite number.", param=name, code="invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"'{name}' must be in {bound}; got {value}.", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise InvalidRequest(f"'{name}' must be an integer.", param=name, code="invalid_type")
    if value < lo or value > hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}; got {value}.", param=name)
    return value


def _text_of(content: Any, param: str) -> str:
    """Message content: a string, null, or a list of {type: text, text} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise InvalidRequest("Only text content parts are supported.", param=f"{param}[{j}]")
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    "A text part needs a string 'text'.", param=f"{param}[{j}].text", code="invalid_type"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest("'content' must be a string or a list of text parts.", param=param, code="invalid_type")


def parse_messages(value: Any) -> list[dict]:
    if value is None:
        raise InvalidRequest("'messages' is required.", param="messages", code="missing_required_parameter")
    if not isinstance(value, list):
        raise InvalidRequest("'messages' must be an array.", param="messages", code="invalid_type")
    if not value:
        raise InvalidRequest("'messages' must not be empty.", param="messages", code="empty_array")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequest(f"At most {MAX_MESSAGES} messages.", param="messages")
    messages = []
    for i, m in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest("Each message must be an object.", param=param, code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"Unknown role {role!r}; expected one of {', '.join(ROLES)}.", param=f"{param}.role")
        text = _text_of(m.get("content"), f"{param}.content")
        if len(text) > MAX_MESSAGE_CHARS:
            raise InvalidRequest(
                f"A message may hold at most {MAX_MESSAGE_CHARS} characters.", param=f"{param}.content"
            )
        msg = {"role": "system" if role == "developer" else role, "content": text}
        for extra in ("name", "tool_call_id"):
            if m.get(extra) is not None:
                if not isinstance(m[extra], str):
                    raise InvalidRequest(f"'{extra}' must be a string.", param=f"{param}.{extra}", code="invalid_type")
                msg[extra] = m[extra]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{param}.tool_calls")
        messages.append(msg)
    return messages


def _tool_calls(value: Any, param: str) -> list[dict]:
    """An assistant message's earlier tool calls: [{id, type: function, function: {name, arguments}}]."""
    if not isinstance(value, list):
        raise InvalidRequest("'tool_calls' must be an array.", param=param, code="invalid_type")
    calls = []
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                "A tool call is {id, type: function, function: {name, arguments}}.",
                param=f"{param}[{j}]",
                code="invalid_type",
            )
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise InvalidRequest(
                "'arguments' must be a JSON string.", param=f"{param}[{j}].function.arguments", code="invalid_type"
            )
        calls.append(
            {"id": str(c.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return calls


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("'stop' must be a string or an array of strings.", param="stop", code="invalid_type")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LEN or not s for s in stops):
        raise InvalidRequest(
            f"At most {MAX_STOP} non-empty stop strings of up to {MAX_STOP_LEN} characters.", param="stop"
        )
    return stops


@dataclass
class ChatRequest:
    messages: list[dict]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)
    request_class: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list = field(default_factory=list)  # apps.api.tools.Tool
    tool_choice: Any = "none"  # none | auto | required | a Tool
    parallel_tool_calls: bool = True
    grammar: str | None = None  # llguidance grammar: response_format or a forced tool call
    response_format: str = "text"
    deadline: float | None = None  # seconds, None: server.deadline


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean.", param=name, code="invalid_type")
    return value


def parse_common(body: dict) -> dict:
    """The fields chat and legacy completions share: model, stream, caps, sampling, stop, n, class, deadline."""
    from django.conf import settings

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string.", param="model", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options", code="invalid_type")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    request_class = body.get("class")
    if request_class is not None and request_class not in ("interactive", "agent"):
        raise InvalidRequest("'class' must be 'interactive' or 'agent'.", param="class")
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    sampling = {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": _integer(body, "top_k", -1, 1 << 20) or 0,
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        "seed": None if seed is None else seed % (1 << 64),
    }
    if sampling["top_k"] < 0:  # -1 is vLLM's "off"
        sampling["top_k"] = 0
    deadline_max = settings.IGNIS.get("server.deadline_max", 3600.0)
    deadline = None
    if body.get("deadline") is not None:
        deadline = _number(body, "deadline", 0.0, 0.0, deadline_max, lo_open=True)
    return {
        "model": model,
        "stream": _bool(body, "stream", False),
        "include_usage": bool(options.get("include_usage")),
        "max_tokens": max_tokens,
        "stop": parse_stop(body.get("stop")),
        "sampling": sampling,
        "request_class": request_class,
        "n": _integer(body, "n", 1, MAX_N) or 1,
        "deadline": deadline,
    }


def parse_chat_request(body: dict) -> ChatRequest:
    from apps.api import tools as tool_mod
    from apps.api.logprobs import MAX_TOP_LOGPROBS

    common = parse_common(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            "'chat_template_kwargs' must be an object.", param="chat_template_kwargs", code="invalid_type"
        )
    logprobs = _bool(body, "logprobs", False)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    tools = tool_mod.tools_parse(body.get("tools"))
    choice = tool_mod.tool_choice_parse(body.get("tool_choice"), tools)
    parallel = _bool(body, "parallel_tool_calls", True)
    grammar = tool_mod.tool_choice_grammar(choice, tools, parallel)
    fmt_grammar, fmt = tool_mod.response_format_grammar(body.get("response_format"))
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        template_kwargs=kwargs,
        logprobs=logprobs,
        top_logprobs=top or 0,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        grammar=grammar or fmt_grammar,
        response_format=fmt,
        **common,
    )


@dataclass
class CompletionRequest:
    """POST /v1/completions: a raw prompt (text or token ids), no template."""

    prompts: list  # each a str or a list of token ids
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)
    request_class: str | None = None
    n: int = 1
    deadline: float | None = None
    echo: bool = False
    logprobs: int | None = None  # legacy: None (off) or how many alternatives
    suffix: str | None = None
    grammar: str | None = None


def _prompts(value: Any) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [value]
        if all(isinstance(p, str) for p in value):
            return value
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value
        ):
            return value
    raise InvalidRequest(
        "'prompt' must be a string, an array of strings, an array of token ids, or an array of token-id arrays.",
        param="prompt",
        code="invalid_type",
    )


def parse_completion_request(body: dict) -> CompletionRequest:
    from apps.api.logprobs import MAX_TOP_LOGPROBS
    from apps.api.tools import response_format_grammar

    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required.", param="prompt", code="missing_required_parameter")
    prompts = _prompts(body["prompt"])
    if len(prompts) > MAX_N:
        raise InvalidRequest(f"At most {MAX_N} prompts per request.", param="prompt")
    if any(len(p) > MAX_MESSAGE_CHARS for p in prompts):
        raise InvalidRequest(f"A prompt may hold at most {MAX_MESSAGE_CHARS} characters.", param="prompt")
    zero = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    common = parse_common({k: v for k, v in body.items() if not (zero and k == "max_tokens")})
    if zero:
        common["max_tokens"] = 0  # score the prompt (with echo), generate nothing
    if len(prompts) * common["n"] > MAX_N:
        raise InvalidRequest(f"At most {MAX_N} choices (prompts times n) per request.", param="n")
    best_of = _integer(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != common["n"]:
        raise InvalidRequest("'best_of' other than n is not supported.", param="best_of")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("'suffix' must be a string.", param="suffix", code="invalid_type")
    grammar, _ = response_format_grammar(body.get("response_format"))
    return CompletionRequest(
        prompts=prompts,
        echo=_bool(body, "echo", False),
        logprobs=_integer(body, "logprobs", 0, MAX_TOP_LOGPROBS),
        suffix=suffix or None,
        grammar=grammar,
        **common,
    )
