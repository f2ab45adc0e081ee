"""Non-streaming routes. Views parse, call one service, render."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt

from apps.api.auth import key_presented
from apps.core import engine_client
from apps.core.errors import IgnisError, ModelNotFound, error_response, internal_error
from engine.status import EngineState


def _get_only(request: HttpRequest) -> JsonResponse | None:
    if request.method in ("GET", "HEAD"):
        return None
    return error_response(IgnisError("Use GET here.", code="method_not_allowed", status=405))


# The plain Django views are exempt from CSRF like DRF's: no /v1 route reads a session cookie
# (keys travel in the Authorization header), and a refusal must be the envelope, not an HTML 403.
@csrf_exempt
async def models_list(request):
    """GET /v1/models: every servable model with its status, the running switch and how the last one ended."""
    if refused := _get_only(request):
        return refused
    from apps.api.model_views import models_payload

    return JsonResponse(await models_payload())


@csrf_exempt
async def model_detail(request, model_id: str):
    """GET /v1/models/{id} (the SDK's ``models.retrieve``): that model's entry of GET /v1/models."""
    if refused := _get_only(request):
        return refused
    from apps.api.model_views import models_payload

    for entry in (await models_payload())["data"]:
        if entry["id"] == model_id:
            return JsonResponse(entry)
    return error_response(ModelNotFound(f"The model '{model_id[:256]}' does not exist.", param="model"))


@csrf_exempt
async def health(request: HttpRequest) -> JsonResponse:
    """GET /health: 200 while the engine answers and can serve (serving, or unloaded and
    ready to load on the next request); 503 with its state while loading, switching,
    failed or unreachable, so a balancer sends traffic elsewhere only when it must.
    Open without a key; with keys configured, only a request carrying one sees the
    engine's details (model path, switch history)."""
    if refused := _get_only(request):
        return refused
    status = await engine_client.engine_status()
    state = status.status if status is not None else "unreachable"
    healthy = state in (EngineState.SERVING, EngineState.UNLOADED)
    body = {"status": "ok" if healthy else state}
    presented = request.META.get("HTTP_AUTHORIZATION")
    if key_presented([(b"authorization", presented.encode("latin-1"))] if presented else []):
        body["engine"] = engine_client.engine_status_payload(status)
    return JsonResponse(body, status=200 if healthy else 503)


def _unknown_route(request: HttpRequest) -> JsonResponse:
    return error_response(
        IgnisError(f"Unknown route: {request.method} {request.path[:256]}", code="not_found", status=404)
    )


@csrf_exempt
def not_found(request, path: str = ""):
    """Any method on an unknown /v1 route: the 404 envelope (never a CSRF 403 for a POST)."""
    return _unknown_route(request)


def handler404(request, exception=None):
    """Unknown routes outside /v1 (and any Http404) answer in the envelope too; the admin keeps its page."""
    if request.path.startswith("/admin/"):
        return defaults.page_not_found(request, exception)
    return _unknown_route(request)


def handler500(request):
    """An error no view caught: the envelope, never Django's HTML page (but in the admin)."""
    if request.path.startswith("/admin/"):
        return defaults.server_error(request)
    return error_response(internal_error())
