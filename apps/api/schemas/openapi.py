"""GET /openapi.json: an OpenAPI 3.1 document generated from the declared bodies.

Each strict field states its own JSON Schema (``json_schema()``); a serializer is an
object of its fields (unknown fields are allowed: the API ignores them); a list field
an array of its child; an optional field also takes ``null``. Routes without a body
list their method only. The document is built per request (cheap), so bounds that
follow the configuration (``deadline`` up to ``server.deadline_max``) read as they are now.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from rest_framework import serializers

from apps.api.decisions.schema import DecisionCreate
from apps.api.schemas.chat import ChatBody
from apps.api.schemas.completions import CompletionBody
from apps.api.schemas.decide import DecideBody
from apps.api.schemas.jsonschema import object_schema
from apps.api.schemas.models import (
    CatalogDownloadBody,
    CatalogImportBody,
    DetokenizeBody,
    SwitchBody,
    TokenizeBody,
    config_patch_schema,
)
from apps.api.schemas.responses import ResponseBody

# (path, method, operation summary, body component name or None, its serializer / schema)
BODIES: dict[str, type[serializers.Serializer]] = {
    "ChatCompletionCreate": ChatBody,
    "CompletionCreate": CompletionBody,
    "ResponseCreate": ResponseBody,
    "DecideCreate": DecideBody,
    "DecisionCreate": DecisionCreate,
    "TokenizeRequest": TokenizeBody,
    "DetokenizeRequest": DetokenizeBody,
    "ModelSwitch": SwitchBody,
    "CatalogDownload": CatalogDownloadBody,
    "CatalogImport": CatalogImportBody,
}
ROUTES = [
    ("/v1/chat/completions", "post", "Create a chat completion (SSE with stream)", "ChatCompletionCreate"),
    ("/v1/completions", "post", "Create a legacy text completion", "CompletionCreate"),
    ("/v1/responses", "post", "Create a response (also over a WebSocket)", "ResponseCreate"),
    ("/v1/responses/{response_id}", "get", "A stored response", None),
    ("/v1/responses/{response_id}", "delete", "Forget a stored response", None),
    ("/v1/decide", "post", "Classify from one prefill", "DecideCreate"),
    ("/v1/decisions", "post", "OpenAI's Decisions API", "DecisionCreate"),
    ("/v1/tokenize", "post", "Count a chat request's or a prompt's tokens", "TokenizeRequest"),
    ("/v1/detokenize", "post", "Decode token ids", "DetokenizeRequest"),
    ("/v1/models", "get", "The models and their status", None),
    ("/v1/models/{model_id}", "get", "One model's entry", None),
    ("/v1/models/switch", "post", "Switch the served model (202, runs in the background)", "ModelSwitch"),
    ("/v1/config", "get", "Every configuration key and its value", None),
    ("/v1/config", "patch", "Set configuration keys, atomically", "ConfigPatch"),
    ("/v1/catalog", "get", "Artifacts and their on-disk state", None),
    ("/v1/catalog/download", "post", "Download a known model (202)", "CatalogDownload"),
    ("/v1/catalog/import", "post", "Import an artifact from the models directory (202)", "CatalogImport"),
    ("/health", "get", "Engine status (no key needed)", None),
    ("/openapi.json", "get", "This document (no key needed)", None),
]
ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def body_schemas() -> dict[str, dict]:
    """Every declared body as its JSON Schema, by component name."""
    schemas = {name: object_schema(cls()) for name, cls in BODIES.items()}
    deadline_max = settings.IGNIS.get("server.deadline_max", 3600.0)
    for name in ("ChatCompletionCreate", "CompletionCreate", "ResponseCreate"):
        schemas[name]["properties"]["deadline"]["anyOf"][0]["maximum"] = deadline_max
    schemas["ConfigPatch"] = config_patch_schema()
    return schemas


def _operation(summary: str, body: str | None) -> dict:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op: dict = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK (202 for the background routes; SSE with stream)"},
            "400": {"description": "The request is invalid; `param` names the field", **error},
            "default": {"description": "An error in the OpenAI envelope", **error},
        },
    }
    if body:
        ref = {"$ref": f"#/components/schemas/{body}"}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    return op


def openapi_document() -> dict:
    paths: dict[str, dict] = {}
    for path, method, summary, body in ROUTES:
        paths.setdefault(path, {})[method] = _operation(summary, body)
        if "{" in path:
            name = path.split("{")[1].rstrip("}")
            paths[path]["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ignis",
            "version": "1",
            "description": "An OpenAI-compatible server; docs/API.md describes every route. Unknown body fields are ignored.",
        },
        "paths": paths,
        "components": {
            "schemas": {**body_schemas(), "Error": ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def openapi_view(request: HttpRequest) -> JsonResponse:
    """GET /openapi.json (open, like /health: it says nothing about the server's state)."""
    if request.method not in ("GET", "HEAD"):
        from apps.core.errors import IgnisError

        err = IgnisError("Use GET here.", code="method_not_allowed", status=405)
        return JsonResponse(err.envelope(), status=405)
    return JsonResponse(openapi_document())
