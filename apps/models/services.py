"""The served model as the Django side sees it: its id, its artifact and its tokenizer.

The engine holds the weights; this side holds only what it needs to turn
messages into tokens and tokens back into text. Artifact paths are always
resolved inside the models directory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from django.conf import settings

from apps.api.errors import InvalidRequest, ModelNotFound
from apps.models.download import KNOWN_DOWNLOADS, artifact_path

REQUEST_CLASSES = ("interactive", "agent")


@dataclass
class ServedModel:
    served_id: str
    path: Path

    @cached_property
    def tokenizer(self):
        from engine.tokenizer import load_tokenizer

        return load_tokenizer(self.path)


def models_dir() -> Path:
    return Path(settings.MODELS_DIR).resolve()


def path_confine(raw: str | Path) -> Path:
    """``raw`` resolved (symlinks followed) and proven to lie inside the models directory."""
    root = models_dir()
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = candidate.resolve()
    if resolved != root and root not in resolved.parents:
        raise InvalidRequest("Artifact paths must lie inside the models directory.", param="path",
                             code="invalid_path")
    return resolved


def artifact_locate(served_id: str) -> Path:
    """The artifact on disk for a served id, or ModelNotFound naming the fetch command."""
    spec = KNOWN_DOWNLOADS.get(served_id)
    if spec is not None:
        path = artifact_path(models_dir(), spec)
        if path.exists():
            return path
        raise ModelNotFound(f"The model '{served_id}' is not on disk; fetch it with "
                            f"`python manage.py model download {served_id}`.", param="model")
    folder = path_confine(served_id)
    if folder.is_dir():
        ggufs = sorted(folder.glob("*.gguf"))
        if (folder / "config.json").exists():
            return folder
        if ggufs:
            return ggufs[0]
    raise ModelNotFound(f"The model '{served_id}' does not exist.", param="model")


_lock = threading.Lock()
_served: ServedModel | None = None


def served_model() -> ServedModel:
    """The model this server is configured to serve (its tokenizer loads on first use)."""
    global _served
    with _lock:
        if _served is None:
            cfg = settings.IGNIS
            path = path_confine(cfg["model.path"]) if cfg["model.path"] else artifact_locate(cfg["model.id"])
            _served = ServedModel(served_id=cfg["model.id"], path=path)
        return _served


def model_name_resolve(name: str | None) -> tuple[ServedModel, str | None]:
    """(the model that answers, the class a ``@interactive``/``@agent`` suffix names).

    No name, or the served id, means the loaded model; any other name is a 404.
    """
    served = served_model()
    request_class = None
    if name and "@" in name:
        name, _, suffix = name.rpartition("@")
        if suffix not in REQUEST_CLASSES:
            raise InvalidRequest(f"Unknown lane class '@{suffix}'; use @interactive or @agent.", param="model")
        request_class = suffix
    if name and name != served.served_id:
        raise ModelNotFound(f"The model '{name}' does not exist or is not served here.", param="model")
    return served, request_class
