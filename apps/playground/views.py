"""The Playground at /ui/: one page and its assets, shipped with the project,
talking to the same public API as any client; plus the Monitor's read-only
status route, which reports the numbers /metrics has."""

from __future__ import annotations

import time
from pathlib import Path

from django.http import HttpRequest, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from apps.core import engine_client, engine_state
from apps.core.metrics import engine_samples

STATIC_DIR = Path(__file__).resolve().parent / "static" / "playground"


def assets_version() -> int:
    """The newest asset's mtime: a query string that changes whenever any asset does (cache busting)."""
    return int(max((p.stat().st_mtime for p in STATIC_DIR.rglob("*") if p.is_file()), default=0))


@require_GET
def index(request):
    return render(request, "playground/index.html", {"version": assets_version()})


@require_GET
async def monitor(request: HttpRequest) -> JsonResponse:
    """GET /ui/api/monitor: engine state, lanes and the /metrics samples, from one status reply.

    Read-only: asking the engine for status never counts as using the model. The
    key is checked by the one gate (apps/api/auth.py) before this view runs.
    """
    status = await engine_client.engine_status()
    if status is None:
        state = {"status": "unreachable", "model": None, "backend": None, "error": None}
    else:
        state = {"status": status.status, "model": status.model, "backend": status.backend, "error": status.error}
    lanes = (status.lanes if status is not None else None) or {}
    return JsonResponse(
        {
            "ts": time.time(),
            **state,
            "lanes": lanes.get("lanes") or [],
            "prefill": lanes.get("prefill"),
            "metrics": engine_samples(status),
            # A fleet (docs/FLEET.md): every live worker from the routing table ([] where none is kept).
            "workers": [{**w.describe(), "model": w.model} for w in engine_state.CACHE.live()],
        }
    )
