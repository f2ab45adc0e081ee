"""POST /v1/chat/completions (and /v1/tokenize's chat form): the body as declared serializers.

``SamplingBody`` holds what chat and legacy completions share; ``ChatBody`` adds messages,
logprobs, tools and the chat-only switches. apps.api.validation builds ChatRequest from
the validated data.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail, ValidationError

from apps.api.schemas.fields import AnyJson, Body, Bool, Custom, Enum, Integer, Number, Object, Str, Strict
from apps.api.schemas.tools import ResponseFormat, Tools

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 2048
MAX_MESSAGE_CHARS = 1 << 20  # one message's text; the context bounds the sum
MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_N = 8  # choices per request: each is a sequence holding a decode lane
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents -100..100 per token
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
IMAGE_PART_TYPES = ("image_url", "input_image")
IMAGE_DETAILS = ("auto", "low", "high")
IMAGE_URL_SCHEMA = {
    "anyOf": [
        {"type": "string", "description": "a data: URL; http(s) where server.image_fetch allows"},
        {
            "type": "object",
            "properties": {"url": {"type": "string"}, "detail": {"enum": list(IMAGE_DETAILS)}},
            "required": ["url"],
        },
    ]
}

STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
        {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}},
    ]
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            },
            "required": ["type", "function"],
        },
    ]
}


class StreamOptions(Body):
    include_usage = Bool()


class Stop(Strict):
    """A string or up to MAX_STOP strings, each 1..MAX_STOP_LEN characters."""

    schema = STOP_SCHEMA

    def to_internal_value(self, data: Any) -> list[str]:
        stops = [data] if isinstance(data, str) else data
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            self.bad("'stop' must be a string or an array of strings.", "invalid_type")
        if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_LEN or not s for s in stops):
            self.bad(f"At most {MAX_STOP} non-empty stop strings of up to {MAX_STOP_LEN} characters.")
        return stops


class LogitBias(Strict):
    """{"token id": bias}: ids as decimal strings (JSON keys), biases in [-100, 100]; the vocabulary
    bound is checked once the model is known (apps.api.chat.service)."""

    schema = {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,9}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }

    def to_internal_value(self, data: Any) -> dict[int, float]:
        if not isinstance(data, dict):
            self.bad("{name} must be an object of token ids to biases.", "invalid_type")
        if len(data) > MAX_LOGIT_BIAS:
            self.bad(f"{{name}} may hold at most {MAX_LOGIT_BIAS} tokens.")
        out: dict[int, float] = {}
        for key, bias in data.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                self.bad(f"{{name}} keys are token ids (decimal strings); got {key[:32]!r}.", "invalid_type")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValidationError({key: [ErrorDetail("A bias is a number in [-100, 100].", code="invalid_value")]})
            out[int(key)] = float(bias)
        return out


class SamplingBody(Body):
    """Chat and legacy completions alike: model, stream, caps, sampling, stop, n, class, deadline."""

    model = Str(max_length=1 << 20, description="a served id; `id@agent` / `id@interactive` pick the class")
    stream = Bool()
    stream_options = StreamOptions(required=False, allow_null=True)
    max_completion_tokens = Integer(1, 1 << 30)
    max_tokens = Integer(1, 1 << 30)
    temperature = Number(0.0, 2.0)
    top_p = Number(0.0, 1.0, lo_open=True)
    top_k = Integer(-1, 1 << 20, description="extension: -1 or 0 is off")
    min_p = Number(0.0, 1.0, description="extension")
    presence_penalty = Number(-2.0, 2.0)
    frequency_penalty = Number(-2.0, 2.0)
    repetition_penalty = Number(0.0, 10.0, lo_open=True, description="extension")
    seed = Integer(-(1 << 63), (1 << 64) - 1)
    stop = Stop()
    n = Integer(1, MAX_N)
    deadline = Number(0.0, 1e9, lo_open=True, description="extension: seconds, at most server.deadline_max")
    ignore_eos = Bool(description="keep generating past the model's end-of-sequence tokens")
    min_tokens = Integer(0, 1 << 30, description="the EOS and stop token ids cannot end the output before this many")
    logit_bias = LogitBias()
    response_format = ResponseFormat()

    def get_fields(self):
        fields = super().get_fields()
        fields["class"] = Enum("interactive", "agent", message="'class' must be 'interactive' or 'agent'.")
        return fields

    def validate_deadline(self, value):
        top = settings.IGNIS.get("server.deadline_max", 3600.0)
        if value is not None and value > top:
            raise ValidationError(f"'deadline' must be in (0.0, {top}]; got {value}.", code="invalid_value")
        return value


class TextPart(Body):
    type = Enum(*TEXT_PART_TYPES, required=True, message="Only text content parts are supported.")
    text = Str(required=True, max_length=MAX_MESSAGE_CHARS)


class ImagePart(Body):
    """``{type: image_url, image_url: {url, detail?}}`` (chat) or ``{type: input_image, image_url: url}`` (Responses)."""

    type = Enum(*IMAGE_PART_TYPES, required=True)
    image_url = Custom(IMAGE_URL_SCHEMA, required=True)
    detail = Enum(*IMAGE_DETAILS)


def _bad_part(j: int, message: str, code: str = "invalid_value", field: str | None = None) -> ValidationError:
    detail = [ErrorDetail(message, code=code)]
    return ValidationError({j: {field: detail} if field else detail})


def _image_part(part: dict, j: int) -> dict:
    """An image part as ``{type: image_url, image_url: {url, detail}, param: content[j]}`` whichever form it came in."""
    raw = part.get("image_url")
    if isinstance(raw, dict):
        url, detail = raw.get("url"), raw.get("detail")
        if not isinstance(url, str):
            raise ValidationError({j: {"image_url": {"url": [ErrorDetail("An image_url needs a string 'url'.", code="invalid_type")]}}})  # fmt: skip
    elif isinstance(raw, str):
        url, detail = raw, None
    elif raw is None and part.get("file_id") is not None:
        raise _bad_part(j, "Image parts by file_id are not supported: send a data: URL.", "invalid_image")
    else:
        raise _bad_part(j, "An image part needs 'image_url': a URL string or {url, detail}.", "invalid_type", "image_url")  # fmt: skip
    detail = detail if detail is not None else part.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise _bad_part(j, f"'detail' must be one of {', '.join(IMAGE_DETAILS)}.", field="detail")
    return {
        "type": "image_url",
        "image_url": {"url": url, "detail": detail or "auto"},
        "param": f"content[{j}]",
        "index": j,
    }


class Content(Strict):
    """A string, null, or a list of {type: text, text} parts; returned as the joined text.

    With ``images``: image parts too (``image_url`` / ``input_image``); content holding one is
    returned as a list of ``{type: text, text}`` and ``{type: image_url, image_url: {url, detail},
    param}`` parts (``param``: ``content[j]``, the part's place, for its refusals), and text alone
    still as the joined string, so a text-only request renders exactly as before."""

    def __init__(self, *, images: bool = False, **kwargs):
        self.images = images
        super().__init__(**kwargs)

    def json_schema(self) -> dict:
        from apps.api.schemas.jsonschema import object_schema

        part = object_schema(TextPart())
        if self.images:
            part = {"anyOf": [part, object_schema(ImagePart())]}
        return {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}

    def to_internal_value(self, data: Any) -> str | list[dict]:
        parts: list[dict] = []
        if isinstance(data, str):
            text = data
        elif isinstance(data, list):
            texts = []
            for j, part in enumerate(data):
                kind = part.get("type") if isinstance(part, dict) else None
                if self.images and kind in IMAGE_PART_TYPES:
                    parts.append(_image_part(part, j))
                    continue
                if kind not in TEXT_PART_TYPES:
                    what = "text and image" if self.images else "text"
                    raise _bad_part(j, f"Only {what} content parts are supported.")
                if not isinstance(part.get("text"), str):
                    raise _bad_part(j, "A text part needs a string 'text'.", "invalid_type", "text")
                texts.append(part["text"])
                parts.append({"type": "text", "text": part["text"]})
            text = "".join(texts)
        else:
            self.bad("'content' must be a string or a list of text parts.", "invalid_type")
        if len(text) > MAX_MESSAGE_CHARS:
            self.bad(f"A message may hold at most {MAX_MESSAGE_CHARS} characters.")
        if any(p["type"] == "image_url" for p in parts):
            return parts
        return text


def image_params(content: Any, prefix: str, role: str) -> Any:
    """A message's validated content with each image part's ``param`` under ``prefix``
    (``messages[2].``); an image anywhere but in a user message is refused (errors keyed as
    ``content[j]``: the caller nests them under the message)."""
    if not isinstance(content, list):
        return content
    for part in content:
        if part["type"] == "image_url":
            j = part.pop("index")
            if role != "user":
                raise ValidationError({"content": {j: [ErrorDetail("Only user messages may hold images.", code="invalid_image")]}})  # fmt: skip
            part["param"] = prefix + part["param"]
    return content


class FunctionCall(Body):
    name = Str(required=True, max_length=256)
    arguments = Str(description="JSON text")


class ToolCall(Body):
    id = AnyJson()
    type = AnyJson()
    function = FunctionCall(required=True)


class Message(Body):
    role = Enum(*ROLES, required=True)
    content = Content(images=True)
    name = Str(max_length=256)
    tool_call_id = Str(max_length=256)
    tool_calls = serializers.ListField(child=ToolCall(), required=False, allow_null=True)

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise ValidationError(
                {"non_field_errors": [ErrorDetail("Each message must be an object.", code="invalid_type")]}
            )
        role = data.get("role")
        if role not in ROLES:
            raise ValidationError(
                {"role": [ErrorDetail(f"Unknown role {role!r:.40}; expected one of {', '.join(ROLES)}.")]}
            )
        return super().to_internal_value(data)


class Messages(Strict):
    """1..MAX_MESSAGES messages, as {role, content (text), name?, tool_call_id?, tool_calls?}."""

    def json_schema(self) -> dict:
        from apps.api.schemas.jsonschema import object_schema

        return {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": object_schema(Message())}

    def to_internal_value(self, data: Any) -> list[dict]:
        if not isinstance(data, list):
            self.bad("'messages' must be an array.", "invalid_type")
        if not data:
            self.bad("'messages' must not be empty.", "empty_array")
        if len(data) > MAX_MESSAGES:
            self.bad(f"At most {MAX_MESSAGES} messages.")
        out = []
        for i, raw in enumerate(data):
            ser = Message(data=raw)
            if not ser.is_valid():
                raise ValidationError({i: ser.errors})
            m = ser.validated_data
            try:
                content = image_params(m.get("content") or "", f"messages[{i}].", m["role"])
            except ValidationError as exc:
                raise ValidationError({i: exc.detail}) from None
            msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
            for extra in ("name", "tool_call_id"):
                if m.get(extra) is not None:
                    msg[extra] = m[extra]
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = [
                    {
                        "id": str(c.get("id") or ""),
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": c["function"].get("arguments") or "{}",
                        },
                    }
                    for c in m["tool_calls"]
                ]
            out.append(msg)
        return out


class Prediction(Body):
    """OpenAI Predicted Outputs: text the answer is expected to repeat, proposed as drafts."""

    type = Enum("content", required=True, message="Only 'content' predictions are supported.")
    content = Content(required=True)


class ChatBody(SamplingBody):
    messages = Messages(required=True)
    chat_template_kwargs = Object(description="extension: variables for the chat template")
    logprobs = Bool()
    top_logprobs = Integer(0, MAX_TOP_LOGPROBS)
    tools = Tools()
    tool_choice = Custom(TOOL_CHOICE_SCHEMA)
    parallel_tool_calls = Bool()
    reasoning_effort = Enum(
        *REASONING_EFFORTS, description="mapped to the chat template's enable_thinking and a thinking budget"
    )
    max_reasoning_tokens = Integer(0, 1 << 30, description="extension: the thinking budget, in tokens")
    prediction = Prediction(required=False, allow_null=True)

    def validate(self, data):
        if data.get("top_logprobs") is not None and not data.get("logprobs"):
            raise ValidationError({"top_logprobs": [ErrorDetail("'top_logprobs' needs 'logprobs': true.")]})
        return data
