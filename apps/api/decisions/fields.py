"""Strict DRF fields for request schemas: leaves that never coerce, tagged unions, and
the first error of a nested DRF error detail as an OpenAI ``param`` path.

DRF's own fields coerce (``CharField`` turns 5 into "5"; ``BooleanField``
takes "yes"), so the leaves here are strict: a string is a ``str``, a choice
value a ``str`` or a ``bool``, nothing else. Error codes are this API's
(docs/API.md, Errors): ``invalid_type``, ``invalid_value``, ``empty_array``,
``limit_exceeded``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail, ValidationError

MAX_TEXT = 1 << 20  # characters in one string
MAX_ITEMS = 2048
MAX_OPTION_TEXT = 200  # a choice value or level label
MAX_JSON_DEPTH = 32  # input_json, as the SDK documents it
MAX_JSON_VALUES = 10_000
MAX_JSON_BYTES = 256 * 1024


def fail(message: str, code: str = "invalid_value") -> None:
    raise ValidationError(message, code=code)


class Text(serializers.Field):
    """A ``str`` (never coerced), valid UTF-8 (no lone surrogate), bounded; blank only if allowed."""

    def __init__(self, *, max_length: int = MAX_TEXT, allow_blank: bool = True, **kwargs):
        self.max_length, self.allow_blank = max_length, allow_blank
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            fail("Expected a string.", "invalid_type")
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            fail("The string is not valid UTF-8 (a lone surrogate).")
        if len(data) > self.max_length:
            fail(f"At most {self.max_length} characters.")
        if not self.allow_blank and not data.strip():
            fail("Must not be blank.")
        return data

    def json_schema(self) -> dict:
        return {"type": "string", "maxLength": self.max_length, **({} if self.allow_blank else {"pattern": "\\S"})}

    def to_representation(self, value):  # pragma: no cover - requests only
        return value


class Literal(serializers.Field):
    """One of a few exact strings (DRF's ChoiceField matches ``str(data)``, so True would pass as "True")."""

    def __init__(self, *values: str, **kwargs):
        self.values = values
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str) or data not in self.values:
            fail(f"Expected one of: {', '.join(map(repr, self.values))}.")
        return data

    def json_schema(self) -> dict:
        return {"type": "string", "enum": list(self.values)}

    def to_representation(self, value):  # pragma: no cover
        return value


class ChoiceValue(serializers.Field):
    """A choice's value: a string or a boolean, kept typed (``"true"`` and ``true`` are distinct)."""

    def to_internal_value(self, data: Any) -> str | bool:
        if isinstance(data, bool):
            return data
        return Text(max_length=MAX_OPTION_TEXT, allow_blank=False).to_internal_value(data)

    def json_schema(self) -> dict:
        return {"anyOf": [{"type": "boolean"}, Text(max_length=MAX_OPTION_TEXT, allow_blank=False).json_schema()]}

    def to_representation(self, value):  # pragma: no cover
        return value


class OneOf(serializers.Field):
    """An object whose serializer ``pick(data)`` chooses by its discriminator (``type``, ``role``)."""

    def __init__(self, pick: Callable[[dict], type[serializers.Serializer]], **kwargs):
        self.pick = pick
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> dict:
        if not isinstance(data, dict):
            fail("Expected an object.", "invalid_type")
        ser = self.pick(data)(data=data)  # pick raises ValidationError({key: ...}) for an unknown kind
        if not ser.is_valid():
            raise ValidationError(ser.errors)
        return dict(ser.validated_data)

    def json_schema(self) -> dict:
        from apps.api.schemas.jsonschema import object_schema

        return {"oneOf": [object_schema(cls()) for cls in getattr(self.pick, "variants", ())]} or {"type": "object"}

    def to_representation(self, value):  # pragma: no cover
        return value


class Either(serializers.Field):
    """A string, or a list of parts (``content``, ``output``, ``instructions``)."""

    def __init__(self, parts: serializers.Field, *, max_items: int = MAX_ITEMS, **kwargs):
        self.parts, self.max_items = parts, max_items
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str | list[dict]:
        if isinstance(data, str):
            return Text().to_internal_value(data)
        if not isinstance(data, list):
            fail("Expected a string or an array of parts.", "invalid_type")
        if not data:
            fail("Give at least one part.", "empty_array")
        if len(data) > self.max_items:
            fail(f"At most {self.max_items} parts.", "limit_exceeded")
        out, errors = [], {}
        for i, part in enumerate(data):
            try:
                out.append(self.parts.to_internal_value(part))
            except ValidationError as exc:
                errors[i] = exc.detail
        if errors:
            raise ValidationError(errors)
        return out

    def json_schema(self) -> dict:
        parts = {"type": "array", "minItems": 1, "maxItems": self.max_items, "items": self.parts.json_schema()}
        return {"anyOf": [{"type": "string"}, parts]}

    def to_representation(self, value):  # pragma: no cover
        return value


def tagged(field: str, table: dict[str, type[serializers.Serializer]]):
    """A ``OneOf`` pick: the serializer that ``table`` names for the object's ``field``."""

    def pick(data: dict) -> type[serializers.Serializer]:
        if field not in data:
            raise ValidationError({field: [ErrorDetail("This field is required.", code="missing_required_parameter")]})
        kind = data[field]
        if not isinstance(kind, str) or kind not in table:
            raise ValidationError(
                {field: [ErrorDetail(f"Expected one of: {', '.join(map(repr, table))}.", code="invalid_value")]}
            )
        return table[kind]

    pick.variants = list(dict.fromkeys(table.values()))  # for the OpenAPI document
    return pick


def _json_checked(data: Any) -> Any:
    """input_json's bounds: 32 container levels, 10,000 values, 256 KiB compact (walked without recursion)."""
    if not isinstance(data, (dict, list)) or (isinstance(data, list) and not all(isinstance(x, dict) for x in data)):
        fail("'data' must be an object or an array of objects.", "invalid_type")
    stack, values = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        values += 1
        if values > MAX_JSON_VALUES:
            fail(f"At most {MAX_JSON_VALUES} JSON values.", "limit_exceeded")
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                fail(f"At most {MAX_JSON_DEPTH} nested containers.", "limit_exceeded")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    try:
        size = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    except UnicodeEncodeError:
        fail("The JSON holds a string that is not valid UTF-8 (a lone surrogate).")
    if size > MAX_JSON_BYTES:
        fail(f"At most {MAX_JSON_BYTES} bytes of compact JSON.", "limit_exceeded")
    return data


class JsonData(serializers.Field):
    def to_internal_value(self, data: Any) -> Any:
        return _json_checked(data)

    def json_schema(self) -> dict:
        return {"anyOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}]}

    def to_representation(self, value):  # pragma: no cover
        return value


def first_error(detail: Any, path: str = "") -> tuple[str, ErrorDetail]:
    """The first (param path, error) in DRF's nested error detail (dicts by field or index, lists)."""
    if isinstance(detail, dict):
        key, sub = next(iter(detail.items()))
        if key == "non_field_errors":
            return first_error(sub, path)
        step = f"[{key}]" if isinstance(key, int) else (f".{key}" if path else str(key))
        return first_error(sub, path + step)
    if isinstance(detail, list):
        for i, sub in enumerate(detail):
            if sub:  # a ListSerializer's valid items are {}
                return first_error(sub, path if isinstance(sub, ErrorDetail) else f"{path}[{i}]")
    return path, detail
