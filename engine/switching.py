"""What can refuse a switch, checked before anything is torn down.

A switch is a full reload (engine/host.py): the old model is torn down before
the new one loads, so the two are never resident together. Everything that can
refuse a switch runs *before* the teardown (``switch_precheck``): the file is
there, the digest is clean, and the load's memory plan (engine/memory.py)
fits. A refusal leaves the old model serving. Plain Python: the Django side
imports the digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.memory import RamPlan, ram_plan
from engine.messages import SwitchModel
from engine.model_config import ModelConfig

# Live engine fields (applied without a reload) and the worker's own timings.
LIVE_FIELDS = (
    "prefill_chunk",
    "short_prefill",
    "decode_share",
    "prefill_group",
    "async_rounds",
    "default_max_tokens",
    "spec_enabled",
    "spec_max_draft",
    "spec_cost_aware",
    "loop_guard",
    "loop_guard_min_span",
    "loop_guard_max_span",
    "loop_guard_count",
)


class SwitchRefused(Exception):
    """Raised before teardown: the old model keeps serving."""


def artifact_digest(path: str | Path, progress=None) -> str:
    """sha256 of a GGUF file, or of a HF directory's files (name and bytes, sorted)."""
    p = Path(path)
    h = hashlib.sha256()
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.endswith(".sha256"))
    done = 0
    for f in files:
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress(done)
    return h.hexdigest()


def artifact_config(path: str | Path) -> ModelConfig:
    """The model's shape without reading its weights (GGUF metadata or config.json)."""
    from engine.loaders import read_config

    return read_config(path)


def planned_ram(cfg: ModelConfig, **plan) -> RamPlan:
    """``engine.memory.ram_plan(cfg, **plan)``, or SwitchRefused with its numbers in bytes
    when one max-context sequence does not fit the pool, or the plan does not fit the
    host's available RAM plus what the old model frees at teardown."""
    planned = ram_plan(cfg, **plan)
    if planned.problem is not None:
        raise SwitchRefused(planned.problem)
    return planned


def switch_precheck(
    sw: SwitchModel,
    *,
    ram_budget: int,
    kv_ram_budget: int,
    max_context: int,
    block_size: int,
    backend: str,
    freed_bytes: int,
) -> RamPlan | None:
    """Everything that can refuse ``sw`` before teardown; runs off the event loop."""
    if sw.refuse:
        raise SwitchRefused(sw.refuse)
    path = Path(sw.path)
    if not path.exists():
        raise SwitchRefused(f"no file at {path}")
    try:
        cfg = artifact_config(path)
    except Exception as exc:  # an unreadable header refuses; it never tears down
        raise SwitchRefused(f"not a loadable artifact: {type(exc).__name__}: {exc}") from None
    if sw.sha256:
        got = artifact_digest(path)
        if got != sw.sha256:
            raise SwitchRefused(f"checksum mismatch: sha256 {got} is not the recorded {sw.sha256}")
    if backend not in ("numpy", "cpu"):
        return None  # the CUDA backend plans against the card at load
    return planned_ram(
        cfg,
        ram_budget=ram_budget,
        kv_ram_budget=kv_ram_budget,
        max_context=max_context,
        block_size=block_size,
        freed_bytes=freed_bytes,
    )
