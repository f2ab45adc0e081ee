"""Declared request bodies, one module per endpoint family, and the one way to apply them.

``validated(Body, body)`` runs a DRF serializer over a request body and returns its
validated data, or raises ``InvalidRequest`` naming the first offending ``param`` path
(``messages[2].content[0].text``) with this API's code (docs/API.md, Errors). The same
classes generate GET /openapi.json (apps.api.schemas.openapi).
"""

from __future__ import annotations

from rest_framework import serializers

from apps.api.decisions.fields import first_error
from apps.core.errors import InvalidRequest

# DRF's own codes as this API's.
CODES = {
    "required": "missing_required_parameter",
    "null": "invalid_type",
    "not_a_list": "invalid_type",
    "not_a_dict": "invalid_type",
    "invalid": "invalid_type",
    "invalid_choice": "invalid_value",
}


def validated(body_class: type[serializers.Serializer], body: dict, **context) -> dict:
    """``body`` through ``body_class``: its validated data, or InvalidRequest naming the first param."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    ser = body_class(data=body, context=context)
    if ser.is_valid():
        return dict(ser.validated_data)
    param, err = first_error(ser.errors)
    code = getattr(err, "code", None)
    code = CODES.get(code, code) or "invalid_value"
    message = f"'{param}' is required." if code == "missing_required_parameter" else str(err)
    raise InvalidRequest(message, param=param or None, code=code)


def given(data: dict, name: str, default):
    """A validated optional field: its value, or ``default`` when absent or null."""
    value = data.get(name)
    return default if value is None else value
