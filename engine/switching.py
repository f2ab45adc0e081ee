"""Switching, unloading and reloading the one model: messages, checks and the memory plan.

A switch is a full reload: the old model is torn down before the new one loads,
so the two are never resident together. Everything that can refuse a switch
runs *before* the teardown (``switch_precheck``): the file is there, the digest
is clean, and the load's memory plan fits. A refusal leaves the old model
serving. Plain Python: the Django side imports the messages and the digest.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from engine.messages import SwitchModel
from engine.model_config import ModelConfig

# Live engine fields (applied without a reload) and the worker's own timings.
LIVE_FIELDS = ("prefill_chunk", "decode_share", "default_max_tokens")
_WORKSPACE_LANES = 8


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


def weights_bytes(cfg: ModelConfig) -> int:
    """float32 bytes of the weights a backend holds (the numpy reference's layout)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * h + h * (q + 2 * kv) + q * h + 3 * h * i + ((q + 2 * kv) if cfg.attention_bias else 0)
    params = 2 * cfg.vocab_size * h + h + cfg.num_layers * per_layer  # a tied head is still its own [h, vocab] copy
    return 4 * params


def workspace_bytes(cfg: ModelConfig) -> int:
    return _WORKSPACE_LANES * 4 * (cfg.vocab_size + 4 * cfg.intermediate_size + 4 * cfg.hidden_size)


def mem_available() -> int:
    """Host RAM the kernel says is available (MemAvailable), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


@dataclass(frozen=True)
class RamPlan:
    """The numpy backend's plan, made before anything is torn down."""

    budget_bytes: int
    weights_bytes: int
    workspace_bytes: int
    kv_bytes: int
    min_kv_bytes: int
    available_bytes: int


def ram_plan(
    cfg: ModelConfig, *, ram_budget: int, kv_ram_budget: int, max_context: int, block_size: int, freed_bytes: int
) -> RamPlan:
    """Weights first, then working memory, then the KV pool takes the rest of ``ram_budget``.

    ``ram_budget`` 0 means "weights + workspace + ``kv_ram_budget``". Raises
    SwitchRefused (with the numbers in bytes) when one max-context sequence
    does not fit the pool, or the plan does not fit the host's available RAM
    plus what the old model frees at teardown.
    """
    weights, work = weights_bytes(cfg), workspace_bytes(cfg)
    budget = ram_budget or weights + work + kv_ram_budget
    kv = budget - weights - work
    ctx = min(max_context, cfg.max_position)
    min_kv = math.ceil(ctx / block_size) * block_size * cfg.kv_bytes_per_token_fp32
    available = mem_available() + freed_bytes
    plan = RamPlan(budget, weights, work, kv, min_kv, available)
    if kv < min_kv:
        raise SwitchRefused(
            f"host RAM plan: budget_bytes={budget} weights_bytes={weights} workspace_bytes={work} leave "
            f"kv_bytes={kv}, below the min_kv_bytes={min_kv} one {ctx}-token sequence needs"
        )
    if weights + work > available:
        raise SwitchRefused(
            f"host RAM plan: weights_bytes={weights} + workspace_bytes={work} exceed "
            f"available_bytes={available} (MemAvailable plus the loaded model's plan)"
        )
    return plan


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
    if backend != "numpy":
        return None  # the CUDA backend plans against the card at load
    return ram_plan(
        cfg,
        ram_budget=ram_budget,
        kv_ram_budget=kv_ram_budget,
        max_context=max_context,
        block_size=block_size,
        freed_bytes=freed_bytes,
    )
