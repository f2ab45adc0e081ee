"""POST /v1/tokenize and /v1/detokenize (DRF views: parse, call the service, render)."""

from __future__ import annotations

from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api.schemas import validated
from apps.api.schemas.models import DetokenizeBody, TokenizeBody
from apps.api.tokenize.service import detokenize as detokenize_ids
from apps.api.tokenize.service import tokenize_chat


@api_view(["POST"])
def tokenize(request: Request) -> Response:
    """POST /v1/tokenize: count a chat request's tokens exactly as it would be served."""
    validated(TokenizeBody, request.data)  # the declared shape; tokenize_chat parses it as its route would
    return Response(tokenize_chat(request.data))


@api_view(["POST"])
def detokenize(request: Request) -> Response:
    return Response(detokenize_ids(validated(DetokenizeBody, request.data)["tokens"]))
