"""Parsing request bodies into typed requests, refusing bad input with the param named."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from apps.api.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 2048
MAX_STOP = 4
MAX_STOP_LEN = 256


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object; NaN/Infinity literals are refused like any malformed JSON."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


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
                raise InvalidRequest("A text part needs a string 'text'.", param=f"{param}[{j}].text",
                                     code="invalid_type")
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
        msg = {"role": "system" if role == "developer" else role, "content": _text_of(m.get("content"),
                                                                                      f"{param}.content")}
        for extra in ("name", "tool_call_id", "tool_calls"):
            if m.get(extra) is not None:
                msg[extra] = m[extra]
        messages.append(msg)
    return messages


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("'stop' must be a string or an array of strings.", param="stop", code="invalid_type")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LEN or not s for s in stops):
        raise InvalidRequest(f"At most {MAX_STOP} non-empty stop strings of up to {MAX_STOP_LEN} characters.",
                             param="stop")
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


def parse_chat_request(body: dict) -> ChatRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string.", param="model", code="invalid_type")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidRequest("'stream' must be a boolean.", param="stream", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options", code="invalid_type")
    n = _integer(body, "n", 1, 1)
    del n  # several choices per request arrive with the full API
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
        "top_k": _integer(body, "top_k", 0, 1 << 20) or 0,
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        "seed": None if seed is None else seed % (1 << 64),
    }
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object.", param="chat_template_kwargs",
                             code="invalid_type")
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        model=model,
        stream=bool(stream),
        include_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens,
        stop=parse_stop(body.get("stop")),
        sampling=sampling,
        request_class=request_class,
        template_kwargs=kwargs,
    )
