"""POST /v1/tokenize and /v1/detokenize (DRF views: parse, call the service, render)."""

from __future__ import annotations

from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api.tokenize.service import detokenize as detokenize_ids
from apps.api.tokenize.service import tokenize_chat
from apps.core.errors import InvalidRequest


@api_view(["POST"])
def tokenize(request: Request) -> Response:
    """POST /v1/tokenize: count a chat request's tokens exactly as it would be served."""
    if not isinstance(request.data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return Response(tokenize_chat(request.data))


@api_view(["POST"])
def detokenize(request: Request) -> Response:
    return Response(detokenize_ids(request.data.get("tokens") if isinstance(request.data, dict) else None))
