"""Reads of the catalog: what can be served, and the artifacts (sync ORM: off the event loop)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from apps.models.models import Artifact
from apps.models.services import known_models, served_model


def servable_list() -> list[dict]:
    """Every model a request may name: the serving one, ``switch.known_models``, catalog entries on disk."""
    served = served_model()
    out = {served.served_id: {"id": served.served_id, "artifact": served.path.name}}
    started = settings.IGNIS["model.id"]  # the model this server started with (servable_lookup knows it)
    if started not in out:
        raw = settings.IGNIS["model.path"]
        out[started] = {"id": started, "artifact": Path(raw).name if raw else started}
    for served_id, raw in known_models().items():
        out.setdefault(served_id, {"id": served_id, "artifact": raw or served_id})
    for art in Artifact.objects.filter(state=Artifact.State.ON_DISK):
        out.setdefault(art.served_id, {"id": art.served_id, "artifact": art.path.rsplit("/", 1)[-1]})
    return list(out.values())


def artifact_list() -> list[Artifact]:
    return list(Artifact.objects.all())
