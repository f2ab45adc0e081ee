"""The model routes' bodies: POST /v1/models/switch, PATCH /v1/config, the catalog, /v1/tokenize
and /v1/detokenize. Paths are judged further by apps.models (confined to the models
directory, no NUL: 400 ``invalid_path``)."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ErrorDetail, ValidationError

from apps.api.schemas.chat import ChatBody
from apps.api.schemas.completions import Prompt
from apps.api.schemas.fields import Body, Str, Strict

MAX_PATH = 4096  # apps.models bounds ids and paths more tightly, naming the param


class SwitchBody(Body):
    """{"model": served id} or {"path": artifact relative to the models directory}, or both."""

    model = Str(nonblank=True, max_length=1 << 20)
    path = Str(nonblank=True, max_length=1 << 20)
    worker = Str(nonblank=True, max_length=1 << 20, description="a fleet: the engine worker to switch")


class CatalogDownloadBody(Body):
    id = Str(required=True, nonblank=True, max_length=1 << 20, description="a known model's served id")


class CatalogImportBody(Body):
    path = Str(required=True, nonblank=True, max_length=1 << 20, description="relative to the models directory")
    id = Str(nonblank=True, max_length=1 << 20, description="the served id to give it")


class TokenIds(Strict):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}

    def to_internal_value(self, data: Any) -> list[int]:
        if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
            self.bad("'tokens' must be an array of integers.", "invalid_type")
        return data


class DetokenizeBody(Body):
    tokens = TokenIds(required=True)


class TokenizeBody(ChatBody):
    """A chat request (``messages``, as chat completions validates it) or a legacy ``prompt``."""

    messages = ChatBody._declared_fields["messages"].__class__(required=False)
    prompt = Prompt()

    def validate(self, data):
        if data.get("messages") is None and data.get("prompt") is None:
            raise ValidationError(
                {
                    "messages": [
                        ErrorDetail(
                            "Send 'messages' (a chat) or 'prompt' (a string).", code="missing_required_parameter"
                        )
                    ]
                }
            )
        return super().validate(data)


def config_patch_schema() -> dict:
    """PATCH /v1/config's body: dotted keys (docs/CONFIG.md) with JSON values of their types
    (numbers and booleans may also come as strings); validated by ignis_site.config."""
    from ignis_site.config import FIELDS, START_ONLY_KEYS

    props = {}
    for key, f in FIELDS.items():
        if key in START_ONLY_KEYS:
            continue
        kind = {bool: "boolean", int: "integer", float: "number"}.get(f.type, "string")
        schema: dict = {"type": kind, "description": f.help}
        if f.minimum is not None:
            schema["minimum"] = f.minimum
        if f.maximum is not None:
            schema["maximum"] = f.maximum
        props[key] = {"anyOf": [schema, {"type": "string"}]} if kind != "string" else schema
    return {"type": "object", "properties": props, "additionalProperties": False, "minProperties": 1}
