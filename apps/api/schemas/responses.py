"""POST /v1/responses (and the WebSocket's response.create): the body as declared serializers.

``input`` becomes chat messages here (consecutive function calls are one assistant turn;
reasoning items are left out of the prompt); ``text.format`` is text, json_object or a
json_schema the output is constrained to (apps.api.responses builds the grammar).
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ErrorDetail, ValidationError

from apps.api.schemas.chat import (
    REASONING_EFFORTS,
    TOOL_CHOICE_SCHEMA,
    Content,
    SamplingBody,
    image_params,
)
from apps.api.schemas.fields import Body, Bool, Custom, Enum, Integer, Number, Object, Str, Strict
from apps.api.schemas.tools import Tools

MAX_ITEMS = 2048
INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _err(path: str, message: str, code: str = "invalid_value") -> ValidationError:
    return ValidationError({path: [ErrorDetail(message, code=code)]})


def _item(item: Any) -> dict:
    """One input item as a chat message ({} for a reasoning item); errors keyed by the item's field."""
    if not isinstance(item, dict):
        raise ValidationError("Each input item must be an object.", code="invalid_type")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str):  # a list or object is not even hashable: never a dict lookup
            raise _err("role", f"'role' must be a string: one of {', '.join(INPUT_ROLES)}.", "invalid_type")
        if role not in INPUT_ROLES:
            raise _err("role", f"Unknown role {role!r:.40}; expected one of {', '.join(INPUT_ROLES)}.")
        content = Content(images=True)
        content.bind("content", None)
        try:
            text = content.to_internal_value(item["content"]) if item.get("content") is not None else ""
        except ValidationError as exc:
            raise ValidationError({"content": exc.detail}) from None
        return {"role": INPUT_ROLES[role], "content": image_params(text, "", INPUT_ROLES[role])}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _err(key, f"A function_call item needs a string '{key}'.", "invalid_type")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _err("call_id", "A function_call_output item needs a string 'call_id'.", "invalid_type")
        output = item.get("output")
        if isinstance(output, str):
            text = output
        else:
            content = Content()
            content.bind("output", None)
            try:
                text = content.to_internal_value(output) if output is not None else ""
            except ValidationError as exc:
                raise ValidationError({"output": exc.detail}) from None
        return {"role": "tool", "tool_call_id": item["call_id"], "content": text}
    if kind == "reasoning":
        return {}  # earlier reasoning is not part of the next prompt
    raise _err("type", f"Input items of type {str(kind)[:40]!r} are not supported.")


class Input(Strict):
    """A string (one user message) or up to MAX_ITEMS items; returned as chat messages."""

    def json_schema(self) -> dict:
        text, output = Content(images=True).json_schema(), Content().json_schema()
        string = {"type": "string"}
        items = [
            {
                "type": "object",
                "properties": {"type": {"const": "message"}, "role": {"enum": list(INPUT_ROLES)}, "content": text},
                "required": ["role"],
            },
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": string,
                    "name": string,
                    "arguments": string,
                },
                "required": ["type", "call_id", "name", "arguments"],
            },
            {
                "type": "object",
                "properties": {"type": {"const": "function_call_output"}, "call_id": string, "output": output},
                "required": ["type", "call_id", "output"],
            },
            {"type": "object", "properties": {"type": {"const": "reasoning"}}, "required": ["type"]},
        ]
        return {"anyOf": [string, {"type": "array", "maxItems": MAX_ITEMS, "items": {"anyOf": items}}]}

    def to_internal_value(self, data: Any) -> list[dict]:
        if isinstance(data, str):
            return [{"role": "user", "content": data}]
        if not isinstance(data, list):
            self.bad("'input' must be a string or an array of input items.", "invalid_type")
        if len(data) > MAX_ITEMS:
            self.bad(f"At most {MAX_ITEMS} input items.")
        messages = []
        for i, raw in enumerate(data):
            try:
                m = _item(raw)
            except ValidationError as exc:
                raise ValidationError({i: exc.detail}) from None
            for part in m.get("content") if isinstance(m.get("content"), list) else ():
                if part["type"] == "image_url":
                    part["param"] = f"input[{i}].{part['param']}"
            if m:
                messages.append(m)
        merged: list[dict] = []  # consecutive function calls are one assistant turn
        for m in messages:
            if merged and m.get("tool_calls") and merged[-1].get("tool_calls") and not m["content"]:
                merged[-1]["tool_calls"] += m["tool_calls"]
            else:
                merged.append(m)
        return merged


class TextFormat(Body):
    """``text.format``: {type: text} | {type: json_object} | {type: json_schema, name, schema, strict?, description?}."""

    type = Enum("text", "json_object", "json_schema", required=True)
    name = Str(max_length=64)
    schema = Object(description="the JSON schema the output follows (json_schema)")
    strict = Bool()
    description = Str(max_length=4096)

    def validate(self, data):
        if data["type"] == "json_schema" and data.get("schema") is None:
            raise ValidationError(
                {"schema": [ErrorDetail("A json_schema format needs 'schema'.", code="missing_required_parameter")]}
            )
        return data


class TextParam(Body):
    format = TextFormat(required=False, allow_null=True)
    verbosity = Enum("low", "medium", "high")


class Reasoning(Body):
    effort = Enum(*REASONING_EFFORTS)
    summary = Enum("auto", "concise", "detailed")


class ResponseBody(Body):
    input = Input(required=True)
    instructions = Str()
    model = Str()
    stream = Bool()
    store = Bool(description="default true: keep the response for previous_response_id")
    generate = Bool(description="extension: false prefills and stores, generating nothing")
    previous_response_id = Str(max_length=256)
    max_output_tokens = Integer(1, 1 << 30)
    tools = Tools()
    tool_choice = Custom(TOOL_CHOICE_SCHEMA)
    parallel_tool_calls = Bool()
    temperature = Number(0.0, 2.0)
    top_p = Number(0.0, 1.0, lo_open=True)
    seed = Integer(-(1 << 63), (1 << 64) - 1)
    metadata = Object()
    deadline = Number(0.0, 1e9, lo_open=True, description="extension: seconds, at most server.deadline_max")
    text = TextParam(required=False, allow_null=True)
    reasoning = Reasoning(required=False, allow_null=True)
    max_reasoning_tokens = Integer(0, 1 << 30, description="extension: the thinking budget, in tokens")

    def get_fields(self):
        fields = super().get_fields()
        fields["class"] = Enum("interactive", "agent", message="'class' must be 'interactive' or 'agent'.")
        return fields

    validate_deadline = SamplingBody.validate_deadline
