"""POST /v1/decisions' request body as declared DRF serializers.

The shapes are the official SDK's (``openai/types/decision_create_params.py``):
``input`` is a string or a list of items (messages by role, function and
custom tool calls and their outputs), each question a predicate, choice or
score. ``decisions_parse`` returns the validated body as plain dicts, or
raises ``InvalidRequest`` naming the first offending ``param`` path
(``questions[2].choices[1].value``) and a code from docs/API.md's table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail, ValidationError

from apps.api.decisions.fields import (
    MAX_ITEMS,
    MAX_OPTION_TEXT,
    ChoiceValue,
    Either,
    JsonData,
    Literal,
    OneOf,
    Text,
    fail,
    first_error,
    tagged,
)
from apps.core.errors import InvalidRequest

# Limits (docs/API.md, POST /v1/decisions). Each question is one prefill of its own suffix over
# the retained input, so the number of questions bounds the work a request may ask for; 26
# options is what the lettered fallback (choices that share a first token) can key.
MAX_QUESTIONS = 64
MAX_OPTIONS = 26
MAX_DESCRIPTION = 2000

# DRF's codes as this API's (docs/API.md, Errors).
_CODES = {
    "required": "missing_required_parameter",
    "null": "invalid_type",
    "not_a_list": "invalid_type",
    "not_a_dict": "invalid_type",
    "invalid": "invalid_type",
    "invalid_choice": "invalid_value",
}


# -- content parts -----------------------------------------------------------------------


class Breakpoint(serializers.Serializer):
    mode = Literal("explicit")


class InputText(serializers.Serializer):
    type = Literal("input_text")
    text = Text()
    prompt_cache_breakpoint = Breakpoint(required=False, allow_null=True)  # accepted; retention is automatic


class InputImage(serializers.Serializer):
    type = Literal("input_image")
    image_url = Text()
    detail = Literal("low", "high", "auto", "original", required=False, allow_null=True)
    prompt_cache_breakpoint = Breakpoint(required=False, allow_null=True)


class InputJson(serializers.Serializer):
    type = Literal("input_json")
    data = JsonData()


class OutputText(serializers.Serializer):
    type = Literal("output_text")
    text = Text()


class RefusalPart(serializers.Serializer):
    type = Literal("refusal")
    refusal = Text()


USER_PARTS = {"input_text": InputText, "input_image": InputImage, "input_json": InputJson}
TEXT_PARTS = {"input_text": InputText}
OUTPUT_PARTS = {"input_text": InputText, "input_image": InputImage}
ASSISTANT_PARTS = {"output_text": OutputText, "refusal": RefusalPart}


def _content(table: dict) -> Either:
    return Either(OneOf(tagged("type", table)))


# -- input items -------------------------------------------------------------------------


class UserMessage(serializers.Serializer):
    type = Literal("message", required=False)
    role = Literal("user")
    content = _content(USER_PARTS)


class SystemMessage(serializers.Serializer):  # system and developer
    type = Literal("message", required=False)
    role = Literal("system", "developer")
    content = _content(TEXT_PARTS)


class AssistantMessage(serializers.Serializer):
    type = Literal("message", required=False)
    role = Literal("assistant")
    content = _content(ASSISTANT_PARTS)
    phase = Literal("commentary", "final_answer", required=False, allow_null=True)


_STATUS = ("in_progress", "completed", "incomplete")


class FunctionCall(serializers.Serializer):
    type = Literal("function_call")
    call_id = Text(allow_blank=False, max_length=256)
    name = Text(allow_blank=False, max_length=256)
    arguments = Text()
    id = Text(required=False, allow_null=True)
    namespace = Text(required=False, allow_null=True)
    status = Literal(*_STATUS, required=False, allow_null=True)


class CustomToolCall(FunctionCall):
    type = Literal("custom_tool_call")
    arguments = None
    input = Text()


class FunctionCallOutput(serializers.Serializer):
    type = Literal("function_call_output")
    call_id = Text(allow_blank=False, max_length=256)
    output = _content(OUTPUT_PARTS)
    id = Text(required=False, allow_null=True)
    status = Literal(*_STATUS, required=False, allow_null=True)


class CustomToolCallOutput(FunctionCallOutput):
    type = Literal("custom_tool_call_output")


MESSAGES = {"user": UserMessage, "system": SystemMessage, "developer": SystemMessage, "assistant": AssistantMessage}
ITEMS = {
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "custom_tool_call": CustomToolCall,
    "custom_tool_call_output": CustomToolCallOutput,
}


def _pick_item(data: dict) -> type[serializers.Serializer]:
    if data.get("type", "message") == "message":
        return tagged("role", MESSAGES)(data)
    return tagged("type", ITEMS)(data)


_pick_item.variants = list(dict.fromkeys([*MESSAGES.values(), *ITEMS.values()]))  # for the OpenAPI document


class Input(serializers.Field):
    """A string, or 1..MAX_ITEMS items; each tool output names an earlier call of its kind."""

    def to_internal_value(self, data: Any) -> str | list[dict]:
        if isinstance(data, str):
            return Text(allow_blank=False).to_internal_value(data)
        if not isinstance(data, list):
            fail("'input' must be a string or an array of input items.", "invalid_type")
        if not data:
            fail("Give at least one input item.", "empty_array")
        if len(data) > MAX_ITEMS:
            fail(f"At most {MAX_ITEMS} input items.", "limit_exceeded")
        items, errors, calls = [], {}, set()
        for i, raw in enumerate(data):
            try:
                item = OneOf(_pick_item).to_internal_value(raw)
            except ValidationError as exc:
                errors[i] = exc.detail
                continue
            kind = item.get("type", "message")
            if kind in ("function_call", "custom_tool_call"):
                calls.add((kind, item["call_id"]))
            elif kind.endswith("_output") and (kind.removesuffix("_output"), item["call_id"]) not in calls:
                errors[i] = {"call_id": [ErrorDetail("No earlier call has this call_id.", code="invalid_value")]}
            items.append(item)
        if errors:
            raise ValidationError(errors)
        return items

    def json_schema(self) -> dict:
        items = {"type": "array", "minItems": 1, "maxItems": MAX_ITEMS, "items": OneOf(_pick_item).json_schema()}
        return {"anyOf": [{"type": "string", "pattern": "\\S"}, items]}

    def to_representation(self, value):  # pragma: no cover
        return value


# -- questions ---------------------------------------------------------------------------

QUESTION_PARTS = {"input_text": InputText, "input_image": InputImage, "input_json": InputJson}


class Question(serializers.Serializer):
    name = Text(required=False, allow_null=True, max_length=256)
    instructions = Either(OneOf(tagged("type", QUESTION_PARTS)), max_items=64)

    def validate_instructions(self, value):
        if isinstance(value, str) and not value.strip():
            fail("Must not be blank.")
        return value


class Predicate(Question):
    type = Literal("predicate")


class Choice(serializers.Serializer):
    value = ChoiceValue()
    description = Text(required=False, max_length=MAX_DESCRIPTION)


class Level(serializers.Serializer):
    label = Text(allow_blank=False, max_length=MAX_OPTION_TEXT)
    description = Text(required=False, max_length=MAX_DESCRIPTION)


def _options(value: list, what: str, key: Callable[[dict], Any]) -> list:
    if len(value) < 2:
        fail(f"Give at least 2 {what}.")
    if len(value) > MAX_OPTIONS:
        fail(f"At most {MAX_OPTIONS} {what} per question (the limit is {MAX_OPTIONS}).", "limit_exceeded")
    seen: dict = {}
    for i, option in enumerate(value):
        k = key(option)
        if k in seen:
            raise ValidationError(
                {i: [ErrorDetail(f"Repeats {what[:-1]} {seen[k]}; each must be unique.", code="invalid_value")]}
            )
        seen[k] = i
    return value


class ChoiceQuestion(Question):
    type = Literal("choice")
    choices = serializers.ListField(child=Choice(), allow_empty=True)

    def validate_choices(self, value):  # typed: "true" and true are two choices
        return _options(value, "choices", lambda c: (type(c["value"]), c["value"]))


class ScoreQuestion(Question):
    type = Literal("score")
    levels = serializers.ListField(child=Level(), allow_empty=True)

    def validate_levels(self, value):
        return _options(value, "levels", lambda level: level["label"])


QUESTIONS = {"predicate": Predicate, "choice": ChoiceQuestion, "score": ScoreQuestion}


class Questions(serializers.Field):
    def to_internal_value(self, data: Any) -> list[dict]:
        if not isinstance(data, list):
            fail("'questions' must be an array of questions.", "invalid_type")
        if not data:
            fail("Ask at least one question.", "empty_array")
        if len(data) > MAX_QUESTIONS:
            fail(f"At most {MAX_QUESTIONS} questions per request (the limit is {MAX_QUESTIONS}).", "limit_exceeded")
        out, errors = [], {}
        for i, q in enumerate(data):
            try:
                out.append(OneOf(tagged("type", QUESTIONS)).to_internal_value(q))
            except ValidationError as exc:
                errors[i] = exc.detail
        if errors:
            raise ValidationError(errors)
        return out

    def json_schema(self) -> dict:
        one = OneOf(tagged("type", QUESTIONS)).json_schema()
        return {"type": "array", "minItems": 1, "maxItems": MAX_QUESTIONS, "items": one}

    def to_representation(self, value):  # pragma: no cover
        return value


class PromptCacheOptions(serializers.Serializer):
    mode = Literal("implicit", "explicit", required=False, allow_null=True)
    ttl = Literal("30m", required=False)


class DecisionCreate(serializers.Serializer):
    input = Input()
    questions = Questions()
    model = Text(required=False, allow_null=True, max_length=256)  # optional here, as on every ignis route
    # Accepted and not needed: the engine retains every prefix it computed (docs/API.md).
    prompt_cache_key = Text(required=False, allow_null=True, max_length=1024)
    prompt_cache_options = PromptCacheOptions(required=False, allow_null=True)
    safety_identifier = Text(required=False, allow_null=True, max_length=64)


def decisions_parse(body: dict) -> dict:
    """The validated body, or InvalidRequest naming the first offending param."""
    ser = DecisionCreate(data=body)
    if ser.is_valid():
        return dict(ser.validated_data)
    param, err = first_error(ser.errors)
    code = _CODES.get(getattr(err, "code", None), getattr(err, "code", None)) or "invalid_value"
    message = str(err)
    if code == "missing_required_parameter":
        message = f"'{param}' is required."
    raise InvalidRequest(message, param=param or None, code=code)
