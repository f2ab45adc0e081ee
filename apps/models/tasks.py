"""Celery tasks: downloads and imports, never on the request path."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="ignis.artifact_download")
def artifact_download_task(served_id: str) -> dict:
    from apps.models.catalog import artifact_dict, artifact_download_run

    return artifact_dict(artifact_download_run(served_id=served_id))


@shared_task(name="ignis.artifact_import")
def artifact_import_task(served_id: str) -> dict:
    from apps.models.catalog import artifact_dict, artifact_import_run

    return artifact_dict(artifact_import_run(served_id=served_id))
