"""Strict leaves for the request schemas of chat, completions, responses, tokenize and the
model routes, each declaring its JSON Schema (``json_schema()``) for GET /openapi.json.

The string, literal and union leaves are the Decisions API's (apps/api/decisions/fields.py);
these add numbers, integers, booleans and objects that never coerce (DRF's would take
``"2"`` for 2 and ``"yes"`` for true). Every optional field takes ``null`` as "not given",
as the hand-written parsers did. Messages name the field (``'temperature' must be ...``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import ValidationError


class Body(serializers.Serializer):
    """A request schema whose leaf fields are copied, not rebuilt, for each request. DRF's
    ``get_fields`` deep-copies every declared field, which calls its constructor again with its
    arguments copied: two thirds of a chat request's validation (0.4 of 0.63 ms a request here,
    on the request's path to the engine). A declared leaf is never bound (binding happens on the
    copy) and validation does not change a field, so its shallow copy is the same field; a nested
    serializer is still rebuilt, as it binds fields of its own."""

    def get_fields(self):
        return {
            name: copy.deepcopy(field) if isinstance(field, serializers.BaseSerializer) else _shallow(field)
            for name, field in self._declared_fields.items()
        }


def _shallow(field: serializers.Field) -> serializers.Field:
    """``copy.copy(field)`` without the reduce protocol's detour (a third of the copy's time)."""
    new = object.__new__(type(field))
    new.__dict__.update(field.__dict__)
    return new


class Strict(serializers.Field):
    """Optional fields take null as absent; a required one counts null as missing."""

    schema: dict = {}

    def __init__(self, *, required: bool = False, description: str | None = None, **kwargs):
        kwargs.setdefault("allow_null", not required)
        super().__init__(required=required, help_text=description, **kwargs)

    def validate_empty_values(self, data: Any):
        if data is None and self.required:
            self.fail("required")
        return super().validate_empty_values(data)

    def bad(self, message: str, code: str = "invalid_value") -> None:
        raise ValidationError(message.replace("{name}", f"'{self.field_name}'"), code=code)

    def json_schema(self) -> dict:
        return dict(self.schema)

    def to_representation(self, value):  # pragma: no cover - requests only
        return value


class Number(Strict):
    """A finite JSON number in [lo, hi] (or (lo, hi] with ``lo_open``); booleans are not numbers."""

    def __init__(self, lo: float, hi: float, *, lo_open: bool = False, **kwargs):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            self.bad("{name} must be a finite number.", "invalid_type")
        if data < self.lo or data > self.hi or (self.lo_open and data == self.lo):
            bound = f"({self.lo}, {self.hi}]" if self.lo_open else f"[{self.lo}, {self.hi}]"
            self.bad(f"{{name}} must be in {bound}; got {data}.")
        return float(data)

    def json_schema(self) -> dict:
        low = "exclusiveMinimum" if self.lo_open else "minimum"
        return {"type": "number", low: self.lo, "maximum": self.hi}


class Integer(Strict):
    """An integer in [lo, hi]; an integral float (``3.0``) counts as that integer."""

    def __init__(self, lo: int, hi: int, **kwargs):
        self.lo, self.hi = lo, hi
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            if isinstance(data, float) and math.isfinite(data) and data.is_integer():
                data = int(data)
            else:
                self.bad("{name} must be an integer.", "invalid_type")
        if data < self.lo or data > self.hi:
            self.bad(f"{{name}} must be between {self.lo} and {self.hi}; got {data}.")
        return data

    def json_schema(self) -> dict:
        return {"type": "integer", "minimum": self.lo, "maximum": self.hi}


class Bool(Strict):
    schema = {"type": "boolean"}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.bad("{name} must be a boolean.", "invalid_type")
        return data


class Str(Strict):
    """A string (never coerced), no lone surrogate, at most ``max_length``; ``nonblank`` refuses whitespace."""

    def __init__(self, *, max_length: int = 1 << 20, nonblank: bool = False, **kwargs):
        self.max_length, self.nonblank = max_length, nonblank
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.bad("{name} must be a string.", "invalid_type")
        if len(data) > self.max_length:
            self.bad(f"{{name}} may hold at most {self.max_length} characters.")
        if self.nonblank and not data.strip():
            self.bad("{name} must be a non-empty string.", "invalid_type")
        return data

    def json_schema(self) -> dict:
        return {"type": "string", "maxLength": self.max_length, **({"minLength": 1} if self.nonblank else {})}


class Enum(Strict):
    """One of a few exact strings."""

    def __init__(self, *values: str, message: str | None = None, **kwargs):
        self.values, self.message = values, message
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str) or data not in self.values:
            self.bad(self.message or f"{{name}} must be one of: {', '.join(map(repr, self.values))}.")
        return data

    def json_schema(self) -> dict:
        return {"type": "string", "enum": list(self.values)}


class Object(Strict):
    """A JSON object, taken as it is (a schema, metadata, template arguments)."""

    schema = {"type": "object"}

    def to_internal_value(self, data: Any) -> dict:
        if not isinstance(data, dict):
            self.bad("{name} must be an object.", "invalid_type")
        return data


class AnyJson(Strict):
    """Any JSON value; a later step (a parse function) judges it and names its param."""

    schema = {}

    def to_internal_value(self, data: Any) -> Any:
        return data


class Custom(Strict):
    """A value judged by ``parse(value)`` (the existing tools / stop / prompt parsers, which raise
    InvalidRequest naming their own param); ``schema`` is what the OpenAPI document says of it."""

    def __init__(self, schema: dict, **kwargs):
        self.schema = schema
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        return data
