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

from apps.core.errors import InvalidRequest, ModelNotFound
from apps.models.download import KNOWN_DOWNLOADS, artifact_path

REQUEST_CLASSES = ("interactive", "agent")
# What a client may name, bounded like the catalog's columns (Artifact.served_id, Artifact.path): a
# switch target is kept by the engine and echoed by /health and /v1/models, so it must stay small.
MAX_ID_CHARS = 200
MAX_PATH_CHARS = 1000


@dataclass
class ServedModel:
    served_id: str
    path: Path

    @cached_property
    def tokenizer(self):
        from engine.tokenizer import shared_tokenizer  # the engine's grammars use the same one

        return shared_tokenizer(self.path)


def models_dir() -> Path:
    return Path(settings.MODELS_DIR).resolve()


def path_confine(raw: str | Path) -> Path:
    """``raw`` resolved (symlinks followed) and proven to lie inside the models directory.

    A NUL byte (which no filesystem call accepts) or a path over MAX_PATH_CHARS is a 400.
    """
    text = str(raw)
    if "\x00" in text:
        raise InvalidRequest("A path cannot hold a NUL byte.", param="path", code="invalid_path")
    if len(text) > MAX_PATH_CHARS:
        raise InvalidRequest(f"A path is at most {MAX_PATH_CHARS} characters.", param="path", code="invalid_path")
    root = models_dir()
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = candidate.resolve()
    if resolved != root and root not in resolved.parents:
        raise InvalidRequest("Artifact paths must lie inside the models directory.", param="path", code="invalid_path")
    return resolved


def artifact_locate(served_id: str) -> Path:
    """The artifact on disk for a served id, or ModelNotFound naming the fetch command."""
    spec = KNOWN_DOWNLOADS.get(served_id)
    if spec is not None:
        path = artifact_path(models_dir(), spec)
        if path.exists():
            return path
        raise ModelNotFound(
            f"The model '{served_id}' is not on disk; fetch it with `python manage.py model download {served_id}`.",
            param="model",
        )
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
_by_path: dict[Path, ServedModel] = {}  # tokenizers stay cached across switches back and forth


def served_model() -> ServedModel:
    """The model the engine serves (or last served); its tokenizer loads on first use.

    Starts as the configured ``model.id``; ``served_model_update`` follows the
    engine's status after a switch.
    """
    global _served
    with _lock:
        if _served is None:
            cfg = settings.IGNIS
            path = path_confine(cfg["model.path"]) if cfg["model.path"] else artifact_locate(cfg["model.id"])
            _served = _by_path.setdefault(path, ServedModel(served_id=cfg["model.id"], path=path))
        return _served


def served_model_update(*, served_id: str, path: str | Path) -> ServedModel:
    """Point the Django side at the model the engine reports (after a switch)."""
    global _served
    path = Path(path)
    with _lock:
        model = _by_path.get(path)
        if model is None or model.served_id != served_id:
            model = _by_path[path] = ServedModel(served_id=served_id, path=path)
        _served = model
        return model


def served_model_for(*, served_id: str, path: str | Path) -> ServedModel:
    """The ServedModel (and its tokenizer, cached by path) of a model a fleet worker serves."""
    path = Path(path)
    with _lock:
        model = _by_path.get(path)
        if model is None or model.served_id != served_id:
            model = _by_path[path] = ServedModel(served_id=served_id, path=path)
        return model


def fleet_model(served_id: str | None) -> ServedModel | None:
    """In a fleet of more than one worker: the model a live worker serves under ``served_id`` (no id:
    the primary worker's, the default model's); None otherwise, or where no worker serves it."""
    from apps.core import engine_state

    fleet = engine_state.CACHE
    if len(fleet.workers) < 2:
        return None
    if served_id is None:
        worker = fleet.primary(settings.IGNIS["model.id"])
        workers = [worker] if worker is not None else []
    else:
        workers = [w for w in fleet.live() if w.model == served_id]
    for worker in workers:
        if worker.model and worker.status.path:
            return served_model_for(served_id=worker.model, path=worker.status.path)
    return None


def served_id_check(served_id: str | None, *, param: str = "model") -> None:
    """A served id a client names is at most MAX_ID_CHARS characters (None passes)."""
    if served_id is not None and len(served_id) > MAX_ID_CHARS:
        raise InvalidRequest(f"A model id is at most {MAX_ID_CHARS} characters.", param=param)


def model_name_split(name: str | None) -> tuple[str | None, str | None]:
    """(served id, class) from ``id@interactive`` / ``id@agent``."""
    served_id_check(name)
    request_class = None
    if name and "@" in name:
        name, _, suffix = name.rpartition("@")
        if suffix not in REQUEST_CLASSES:
            raise InvalidRequest(f"Unknown lane class '@{suffix}'; use @interactive or @agent.", param="model")
        request_class = suffix
    return name or None, request_class


def model_name_resolve(name: str | None) -> tuple[ServedModel, str | None]:
    """(the model that answers, the class a ``@interactive``/``@agent`` suffix names).

    No name, or the served id, means the loaded model. Another name is a 404
    here: an implicit switch (``apps.models.switching.model_hold``) has
    already run for the routes that switch, before they prepare the request.
    """
    name, request_class = model_name_split(name)  # a bad name is a 400 whatever is on disk
    in_fleet = fleet_model(name)
    if in_fleet is not None:  # a fleet: the model of the workers the request will go to
        return in_fleet, request_class
    served = served_model()
    if name and name != served.served_id:
        hint = (
            "" if settings.IGNIS["switch.allow_implicit"] else " (implicit switching is off: --switch-allow-implicit)"
        )
        raise ModelNotFound(f"The model '{name}' does not exist or is not served here{hint}.", param="model")
    return served, request_class


@dataclass
class SwitchTarget:
    served_id: str
    path: Path
    sha256: str | None = None
    refuse: str | None = None  # known before teardown: the switch is refused


def _fetch_hint(served_id: str) -> str:
    if served_id in KNOWN_DOWNLOADS:
        return f"fetch it with `python manage.py model download {served_id}`"
    return f"import it with `python manage.py model import <path> --id {served_id}`"


def known_models() -> dict[str, str | None]:
    """``switch.known_models`` as {id: path or None}."""
    out: dict[str, str | None] = {}
    for entry in settings.IGNIS["switch.known_models"].split(","):
        entry = entry.strip()
        if entry:
            sid, _, raw = entry.partition("=")
            out[sid.strip()] = raw.strip() or None
    return out


def servable_lookup(served_id: str) -> SwitchTarget:
    """Where a served id's artifact is, among the models this server knows; ModelNotFound otherwise.

    Known: the serving model, ``switch.known_models`` and catalog entries on
    disk. A catalog model not on disk is a 404 naming the command that fetches
    it: a switch never starts a download. Sync ORM: call it off the event loop.
    """
    from apps.models.models import Artifact

    served = served_model()
    art = Artifact.objects.filter(served_id=served_id).first()
    if art is not None:
        path = path_confine(art.path)
        if art.state != Artifact.State.ON_DISK or not path.exists():
            raise ModelNotFound(f"The model '{served_id}' is not on disk; {_fetch_hint(served_id)}.", param="model")
        return SwitchTarget(served_id, path, art.sha256 or None)
    known = known_models()
    if served_id in known:
        raw = known[served_id]
        path = path_confine(raw) if raw else artifact_locate(served_id)
        return SwitchTarget(served_id, path)
    if served_id in KNOWN_DOWNLOADS:
        return SwitchTarget(served_id, artifact_locate(served_id))
    if served_id == served.served_id:
        return SwitchTarget(served_id, served.path)
    cfg = settings.IGNIS
    if served_id == cfg["model.id"]:  # the model this server started with stays known after a switch away
        return SwitchTarget(
            served_id, path_confine(cfg["model.path"]) if cfg["model.path"] else artifact_locate(served_id)
        )
    raise ModelNotFound(f"The model '{served_id}' does not exist or is not known to this server.", param="model")


def switch_target_resolve(*, served_id: str | None = None, path: str | None = None) -> SwitchTarget:
    """A switch's target from a served id, an artifact path, or both (sync ORM: off the event loop)."""
    from apps.models.models import Artifact

    served_id_check(served_id)
    if not path:
        if not served_id:
            raise InvalidRequest(
                "Name the model to switch to: 'model' (a served id) or 'path'.",
                param="model",
                code="missing_required_parameter",
            )
        return servable_lookup(served_id)
    resolved = path_confine(path)
    root = models_dir()
    rel = str(resolved.relative_to(root))
    art = Artifact.objects.filter(path=rel).first()
    sid = served_id or (art.served_id if art else resolved.parent.name if resolved.is_file() else resolved.name)
    target = SwitchTarget(sid, resolved, art.sha256 if art and art.sha256 else None)
    if served_id:
        try:
            other = servable_lookup(served_id)
        except ModelNotFound:
            other = None
        if other is not None and other.path != resolved:
            target.refuse = f"the id '{served_id}' belongs to the model at {other.path.relative_to(root)}, not {rel}"
    return target
