"""A declared body (a DRF serializer of strict fields) as JSON Schema: a leaf module, so the
fields that describe nested objects (apps/api/decisions/fields.py) and the OpenAPI
document (openapi.py) both use it without importing each other."""

from __future__ import annotations

from rest_framework import serializers


def field_schema(field: serializers.Field) -> dict:
    if isinstance(field, serializers.Serializer):
        schema = object_schema(field)
    elif isinstance(field, serializers.ListField):
        schema = {"type": "array", "items": field_schema(field.child)}
    elif hasattr(field, "json_schema"):
        schema = field.json_schema()
    else:
        schema = {}
    if field.help_text:
        schema = {**schema, "description": str(field.help_text)}
    if field.allow_null:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def object_schema(ser: serializers.Serializer) -> dict:
    """A serializer as a JSON Schema object: its fields, the required ones, extra keys allowed."""
    fields = ser.fields
    schema: dict = {"type": "object", "properties": {name: field_schema(f) for name, f in fields.items()}}
    required = [name for name, f in fields.items() if f.required]
    if required:
        schema["required"] = required
    if ser.__doc__:
        schema["description"] = " ".join(ser.__doc__.split())
    return schema
