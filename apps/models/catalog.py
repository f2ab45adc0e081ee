"""Catalog services: register, download, import and verify artifacts (the admin calls these too).

Downloads and imports run as Celery tasks (``apps.models.tasks``); the task
bodies are the ``*_run`` functions here, which the ``model`` command also calls
directly. Progress (bytes and total) is written to the Artifact row, where the
API, the admin and the Playground read it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from celery import shared_task

from apps.core.errors import InvalidRequest, ModelNotFound
from apps.models.download import KNOWN_DOWNLOADS, artifact_path, download_pypi_gguf
from apps.models.models import Artifact
from apps.models.services import models_dir, path_confine, served_id_check
from engine.switching import artifact_digest

State = Artifact.State


def _rel(path: Path) -> str:
    return str(path.relative_to(models_dir()))


def _format(path: Path) -> str:
    return "gguf" if path.is_file() and path.suffix.lower() == ".gguf" else "hf" if path.is_dir() else ""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def artifact_sync() -> list[Artifact]:
    """Rows for the known downloads, and every row's on-disk state checked against the disk."""
    for served_id, spec in KNOWN_DOWNLOADS.items():
        path = artifact_path(models_dir(), spec)
        art, _ = Artifact.objects.get_or_create(
            served_id=served_id,
            defaults={"path": _rel(path), "format": "gguf", "source": f"pypi:{spec.package}=={spec.version}"},
        )
        record = path.with_name(path.name + ".sha256")
        if path.exists() and record.exists() and not art.sha256:
            art.sha256 = json.loads(record.read_text())["sha256"]
            art.save(update_fields=["sha256"])
    for art in Artifact.objects.exclude(state__in=[State.DOWNLOADING, State.IMPORTING]):
        try:
            exists = path_confine(art.path).exists()
        except InvalidRequest:
            exists = False
        state = State.ON_DISK if exists else State.MISSING if art.state != State.FAILED else State.FAILED
        if exists and not art.size_bytes:
            art.size_bytes = _size(path_confine(art.path))
        if state != art.state or exists:
            art.state = state
            art.save(update_fields=["state", "size_bytes"])
    return list(Artifact.objects.all())


class _Progress:
    """Writes bytes done to the row at most every ``every`` seconds."""

    def __init__(self, art: Artifact, echo=None, every: float = 0.5):
        self.art, self.echo, self.every, self.at = art, echo, every, 0.0

    def __call__(self, done: int, total: int | None = None) -> None:
        now = time.monotonic()
        if total is not None:
            self.art.progress_total = total
        self.art.progress_bytes = done
        if now - self.at >= self.every or done == self.art.progress_total:
            self.at = now
            Artifact.objects.filter(pk=self.art.pk).update(progress_bytes=done, progress_total=self.art.progress_total)
            if self.echo:
                self.echo(self.art)


def artifact_download(*, served_id: str) -> Artifact:
    """Queue the download of a known model (a Celery task); returns the row with its task id."""
    served_id_check(served_id, param="id")
    if served_id not in KNOWN_DOWNLOADS:
        raise ModelNotFound(f"There is no known download named '{served_id}'.", param="id")
    artifact_sync()
    art = Artifact.objects.get(served_id=served_id)
    if art.state in (State.DOWNLOADING, State.IMPORTING):
        return art
    Artifact.objects.filter(pk=art.pk).update(state=State.DOWNLOADING, progress_bytes=0, progress_total=0, error="")
    art.task_id = artifact_download_task.delay(served_id).id
    art.save(update_fields=["task_id"])
    art.refresh_from_db()
    return art


def artifact_download_run(*, served_id: str, echo=None) -> Artifact:
    """The download itself (the task's body; ``model download`` calls it directly)."""
    spec = KNOWN_DOWNLOADS[served_id]
    artifact_sync()
    art = Artifact.objects.get(served_id=served_id)
    art.state = State.DOWNLOADING
    art.save(update_fields=["state"])
    try:
        path, digest = download_pypi_gguf(spec, models_dir(), _Progress(art, echo))
    except Exception as exc:
        Artifact.objects.filter(pk=art.pk).update(state=State.FAILED, error=f"{type(exc).__name__}: {exc}")
        raise
    Artifact.objects.filter(pk=art.pk).update(
        state=State.ON_DISK, sha256=digest, size_bytes=path.stat().st_size, path=_rel(path), error=""
    )
    art.refresh_from_db()
    return art


def artifact_import(*, path: str, served_id: str | None = None) -> Artifact:
    """Queue the import of an artifact already in the models directory (hash, size, format)."""
    art = _import_row(path=path, served_id=served_id)
    art.task_id = artifact_import_task.delay(art.served_id).id
    art.save(update_fields=["task_id"])
    return art


def _import_row(*, path: str, served_id: str | None) -> Artifact:
    served_id_check(served_id, param="id")
    resolved = path_confine(path)
    if not resolved.exists():
        raise InvalidRequest(f"There is nothing at '{path}' in the models directory.", param="path")
    fmt = _format(resolved)
    if fmt == "hf" and not (resolved / "config.json").exists() or not fmt:
        raise InvalidRequest("Import a .gguf file or a directory with config.json.", param="path")
    served_id = served_id or (resolved.stem if resolved.is_file() else resolved.name).lower()
    art, _ = Artifact.objects.update_or_create(
        served_id=served_id,
        defaults={
            "path": _rel(resolved),
            "format": fmt,
            "source": f"import:{_rel(resolved)}",
            "state": State.IMPORTING,
            "progress_bytes": 0,
            "progress_total": _size(resolved),
            "error": "",
        },
    )
    return art


def artifact_import_run(*, served_id: str, echo=None) -> Artifact:
    """Hash and size an imported artifact (the task's body; ``model import`` calls it directly)."""
    art = Artifact.objects.get(served_id=served_id)
    path = path_confine(art.path)
    try:
        digest = artifact_digest(path, _Progress(art, echo))
    except Exception as exc:
        Artifact.objects.filter(pk=art.pk).update(state=State.FAILED, error=f"{type(exc).__name__}: {exc}")
        raise
    total = _size(path)
    Artifact.objects.filter(pk=art.pk).update(
        state=State.ON_DISK, sha256=digest, size_bytes=total, progress_bytes=total, progress_total=total
    )
    art.refresh_from_db()
    return art


def artifact_import_now(*, path: str, served_id: str | None = None, echo=None) -> Artifact:
    art = _import_row(path=path, served_id=served_id)
    return artifact_import_run(served_id=art.served_id, echo=echo)


def artifact_verify(*, served_id: str) -> tuple[bool, str, str]:
    """(clean, actual sha256, recorded sha256) for a catalog entry on disk."""
    art = Artifact.objects.filter(served_id=served_id).first()
    if art is None:
        raise ModelNotFound(f"The model '{served_id}' is not in the catalog.", param="id")
    path = path_confine(art.path)
    if not path.exists():
        raise ModelNotFound(f"The model '{served_id}' is not on disk.", param="id")
    got = artifact_digest(path)
    if not art.sha256:  # nothing recorded yet (an artifact placed by hand): record it now
        Artifact.objects.filter(pk=art.pk).update(sha256=got)
        return True, got, got
    return got == art.sha256, got, art.sha256


def artifact_dict(art: Artifact) -> dict:
    """The API's (and the Playground's) view of one catalog row."""
    return {
        "id": art.served_id,
        "object": "artifact",
        "path": art.path,
        "format": art.format,
        "source": art.source,
        "sha256": art.sha256 or None,
        "size_bytes": art.size_bytes,
        "state": art.state,
        "progress": {"bytes": art.progress_bytes, "total": art.progress_total, "percent": art.progress_percent},
        "task_id": art.task_id or None,
        "error": art.error or None,
    }


# The Celery tasks live beside the services they run (apps.models.tasks names them for
# Celery's autodiscovery), so the two modules do not import each other.
@shared_task(name="ignis.artifact_download")
def artifact_download_task(served_id: str) -> dict:
    return artifact_dict(artifact_download_run(served_id=served_id))


@shared_task(name="ignis.artifact_import")
def artifact_import_task(served_id: str) -> dict:
    return artifact_dict(artifact_import_run(served_id=served_id))
