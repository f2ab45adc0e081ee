"""Model and configuration routes: GET /v1/models' body, POST /v1/models/switch,
GET/PATCH /v1/config, and the catalog (GET /v1/catalog, downloads and imports)."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from apps.api.schemas import validated
from apps.api.schemas.models import CatalogDownloadBody, CatalogImportBody, SwitchBody
from apps.core import engine_state
from apps.core.errors import InvalidRequest
from apps.models import catalog, config_service, selectors
from apps.models.services import served_model, switch_target_resolve
from apps.models.switching import model_switch, status_sync
from engine.status import EngineState, EngineStatus


async def models_payload() -> dict:
    """Every servable model; the loaded one carries the engine's status, the rest are ``unloaded``.

    An engine that does not answer reads as one still loading.
    """
    status = await status_sync() or EngineStatus(status=EngineState.LOADING, model="")
    served = served_model()
    entries = await database_sync_to_async(selectors.servable_list)()
    state = status.status
    switching = status.switching
    involved = {served.served_id} | set((switching or {}).values())
    data = []
    for item in entries:
        entry = {
            "id": item["id"],
            "object": "model",
            "created": 0,
            "owned_by": "ignis",
            "artifact": item["artifact"],
            "status": state if item["id"] in involved else EngineState.UNLOADED,
        }
        if item["id"] in involved:
            entry["switching"] = switching
            entry["last_switch"] = status.last_switch
            if state in (EngineState.LOADING, EngineState.SWITCHING) and status.load_progress:
                entry["load_progress"] = status.load_progress
            if state is EngineState.FAILED:
                entry["error"] = status.error
            if status.max_context:
                entry["max_model_len"] = status.max_context
        data.append(entry)
    return _with_workers({"object": "list", "data": data, "switching": switching, "last_switch": status.last_switch})


def _with_workers(payload: dict) -> dict:
    """Where a listener keeps the routing table: each model lists the workers serving it (``workers``,
    their status), a model a worker serves that the catalog does not know gets an entry of its own,
    and ``workers`` at the top lists every live worker with its model (docs/FLEET.md)."""
    fleet = engine_state.CACHE
    if not fleet.listening:
        return payload
    by_model = fleet.models()
    known = {entry["id"] for entry in payload["data"]}
    for model, workers in by_model.items():
        if model not in known:
            state = workers[0].state
            payload["data"].append(
                {"id": model, "object": "model", "created": 0, "owned_by": "ignis", "artifact": None, "status": state}
            )
    for entry in payload["data"]:
        workers = by_model.get(entry["id"], [])
        entry["workers"] = [w.describe() for w in workers]
        if len(fleet.workers) > 1 and workers:  # a fleet: the model's status is its workers' best
            states = {w.state for w in workers}
            entry["status"] = EngineState.SERVING if EngineState.SERVING in states else workers[0].state
    payload["workers"] = [{**w.describe(), "model": w.model} for w in fleet.live()]
    return payload


@api_view(["POST"])
def models_switch(request: Request) -> Response:
    """POST /v1/models/switch {"model": id} or {"path": artifact}: 202 at once, the work runs in the background."""
    body = validated(SwitchBody, request.data)
    target = switch_target_resolve(served_id=body.get("model"), path=body.get("path"))
    worker = body.get("worker")
    return Response(async_to_sync(model_switch)(target=target, trigger="explicit", worker=worker), status=202)


@api_view(["GET", "PATCH"])
def config_view(request: Request) -> Response:
    """GET /v1/config: every key, its value and how setting it applies. PATCH: set some, atomically."""
    if request.method == "GET":
        return Response(config_service.config_describe())
    if not isinstance(request.data, dict) or not request.data:
        raise InvalidRequest("Send a JSON object of configuration keys and values.", code="invalid_json")
    patch = request.data.get("values", request.data)
    result = async_to_sync(config_service.config_update)(patch=patch)
    return Response(result)


@api_view(["GET"])
def catalog_list(request: Request) -> Response:
    """GET /v1/catalog: artifacts with their on-disk state and download/import progress."""
    catalog.artifact_sync()
    return Response({"object": "list", "data": [catalog.artifact_dict(a) for a in selectors.artifact_list()]})


@api_view(["POST"])
def catalog_download(request: Request) -> Response:
    """POST /v1/catalog/download {"id"}: a Celery task fetches a known model; 202 with its progress row."""
    served_id = validated(CatalogDownloadBody, request.data)["id"]
    return Response(catalog.artifact_dict(catalog.artifact_download(served_id=served_id)), status=202)


@api_view(["POST"])
def catalog_import(request: Request) -> Response:
    """POST /v1/catalog/import {"path", "id"?}: a Celery task hashes an artifact in the models directory."""
    body = validated(CatalogImportBody, request.data if isinstance(request.data, dict) else {})
    path, served_id = body["path"], body.get("id")
    return Response(catalog.artifact_dict(catalog.artifact_import(path=path, served_id=served_id)), status=202)
