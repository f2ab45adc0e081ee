"""Non-streaming routes. Views parse, call one service, render."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api import engine_client, services
from apps.api.auth import key_presented
from apps.api.errors import IgnisError, InvalidRequest
from apps.models.services import served_model
from engine.status import EngineState


def _error_response(err: IgnisError) -> JsonResponse:
    resp = JsonResponse(err.envelope(), status=err.status)
    for k, v in err.headers().items():
        resp[k] = v
    return resp


async def models_list(request):
    """GET /v1/models: every servable model with its status, the running switch and how the last one ended."""
    if request.method != "GET":
        return _error_response(IgnisError("Use GET here.", code="method_not_allowed", status=405))
    from apps.api.model_views import models_payload

    return JsonResponse(await models_payload())


async def health(request: HttpRequest) -> JsonResponse:
    """GET /health: 200 while the engine answers and can serve (serving, or unloaded and
    ready to load on the next request); 503 with its state while loading, switching,
    failed or unreachable, so a balancer sends traffic elsewhere only when it must.
    Open without a key; with keys configured, only a request carrying one sees the
    engine's details (model path, switch history)."""
    status = await engine_client.engine_status()
    state = status.status if status is not None else "unreachable"
    healthy = state in (EngineState.SERVING, EngineState.UNLOADED)
    body = {"status": "ok" if healthy else state}
    presented = request.META.get("HTTP_AUTHORIZATION")
    if key_presented([(b"authorization", presented.encode("latin-1"))] if presented else []):
        body["engine"] = engine_client.engine_status_payload(status)
    return JsonResponse(body, status=200 if healthy else 503)


@api_view(["POST"])
def tokenize(request: Request) -> Response:
    """POST /v1/tokenize: count a chat request's tokens exactly as it would be served."""
    if not isinstance(request.data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return Response(services.tokenize_chat(request.data))


@api_view(["POST"])
def detokenize(request: Request) -> Response:
    tokens = request.data.get("tokens") if isinstance(request.data, dict) else None
    tok = served_model().tokenizer
    vocab = tok.tokenizer.get_vocab_size()
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("'tokens' must be an array of integers.", param="tokens", code="invalid_type")
    if any(t < 0 or t >= vocab for t in tokens):
        raise InvalidRequest(f"Token ids must be in [0, {vocab}).", param="tokens")
    return Response({"text": tok.decode(tokens)})


def not_found(request, path: str = ""):
    return _error_response(IgnisError(f"Unknown route: {request.method} /{path}", code="not_found", status=404))
