"""Function tools and structured-output formats as declared fields (chat, Responses, tokenize).

``Tools`` takes chat's shape ``{type: function, function: {name, description, parameters}}``
and the Responses API's flat ``{type: function, name, description, parameters}``; names are
unique, parameter schemas at most MAX_SCHEMA_CHARS. ``ResponseFormat`` is chat's
``response_format``. apps.api.tools turns the validated values into Tool objects and grammars.
"""

from __future__ import annotations

import json
from typing import Any

from rest_framework.exceptions import ErrorDetail, ValidationError

from apps.api.schemas.fields import Body, Bool, Object, Str, Strict

MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 * 1024
FORMATS = ("text", "json_object", "json_schema")


def schema_checked(value: Any) -> dict:
    """A JSON schema given by the request: an object of at most MAX_SCHEMA_CHARS characters."""
    if not isinstance(value, dict):
        raise ValidationError("A JSON schema must be an object.", code="invalid_type")
    if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise ValidationError(f"A JSON schema may be at most {MAX_SCHEMA_CHARS} characters.", code="invalid_value")
    return value


class ToolFunction(Body):
    name = Str(required=True, max_length=256)
    description = Str(max_length=64 * 1024)
    parameters = Object(description="a JSON schema; absent: no arguments")
    strict = Bool()

    def validate_name(self, value):
        if not value:
            raise ValidationError("A tool needs a function with a non-empty string 'name'.", code="invalid_value")
        return value

    def validate_parameters(self, value):
        return None if value is None else schema_checked(value)


class Tools(Strict):
    """Up to MAX_TOOLS function tools, returned as [{name, description, parameters}]."""

    def json_schema(self) -> dict:
        from apps.api.schemas.jsonschema import object_schema

        fn = object_schema(ToolFunction())
        nested = {
            "type": "object",
            "properties": {"type": {"const": "function"}, "function": fn},
            "required": ["function"],
        }
        flat = {**fn, "properties": {"type": {"const": "function"}, **fn["properties"]}, "required": ["type", "name"]}
        return {"type": "array", "maxItems": MAX_TOOLS, "items": {"anyOf": [nested, flat]}}

    def to_internal_value(self, data: Any) -> list[dict]:
        if not isinstance(data, list):
            self.bad("'tools' must be an array.", "invalid_type")
        if len(data) > MAX_TOOLS:
            self.bad(f"At most {MAX_TOOLS} tools.")
        tools, names = [], set()
        for i, t in enumerate(data):
            if not isinstance(t, dict):
                raise ValidationError({i: [ErrorDetail("Each tool must be an object.", code="invalid_type")]})
            if t.get("type", "function") != "function":
                raise ValidationError({i: {"type": [ErrorDetail("Only function tools are supported.")]}})
            nested = "function" in t
            ser = ToolFunction(data=t["function"] if nested else t)
            if not ser.is_valid():
                raise ValidationError({i: {"function": ser.errors} if nested else ser.errors})
            fn = ser.validated_data
            if fn["name"] in names:
                detail = [ErrorDetail(f"Two tools are named {fn['name'][:64]!r}.")]
                raise ValidationError({i: {"function": {"name": detail}} if nested else {"name": detail}})
            names.add(fn["name"])
            params = fn.get("parameters")
            tools.append(
                {
                    "name": fn["name"],
                    "description": fn.get("description") or "",
                    "parameters": {"type": "object", "properties": {}} if params is None else params,
                }
            )
        return tools


class JsonSchemaSpec(Body):
    name = Str(max_length=256)
    schema = Object()
    strict = Bool(description="accepted; always in effect")
    description = Str(max_length=64 * 1024)

    def validate_schema(self, value):
        return None if value is None else schema_checked(value)


class ResponseFormat(Strict):
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {name, schema, strict?}}``."""

    def json_schema(self) -> dict:
        from apps.api.schemas.jsonschema import object_schema

        return {
            "anyOf": [
                {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
                {
                    "type": "object",
                    "properties": {"type": {"const": "json_schema"}, "json_schema": object_schema(JsonSchemaSpec())},
                    "required": ["type", "json_schema"],
                },
            ]
        }

    def to_internal_value(self, data: Any) -> dict:
        if not isinstance(data, dict) or data.get("type") not in FORMATS:
            self.bad('{name} is {"type": "text" | "json_object" | "json_schema"}.')
        if data["type"] != "json_schema":
            return {"type": data["type"]}
        spec = data.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError(
                {"json_schema": [ErrorDetail('json_schema needs {"name": ..., "schema": {...}}.', code="invalid_type")]}
            )
        ser = JsonSchemaSpec(data=spec)
        if not ser.is_valid():
            raise ValidationError({"json_schema": ser.errors})
        return {"type": "json_schema", "json_schema": dict(ser.validated_data)}
