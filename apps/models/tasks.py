"""Celery tasks: downloads and imports, never on the request path.

Defined in apps.models.catalog beside the services they run; named here for
Celery's autodiscovery (``<app>.tasks``).
"""

from apps.models.catalog import artifact_download_task, artifact_import_task

__all__ = ["artifact_download_task", "artifact_import_task"]
