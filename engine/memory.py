"""The memory plan: weights, workspace, the KV pool and the host tier, in bytes.

One module for both backends and the switch precheck, so the figure a switch
is refused on is the one a load then carves: weights first, then the working
memory of one round (``workspace_bytes``, the one formula), then the KV pool
takes what the budget leaves, and the host tier holds swapped pages. The numpy
backend's budget is host RAM, planned before a load (``ram_plan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine.model_config import ModelConfig

# A decode round's rows the workspace is sized for (the most lanes a round carries).
WORKSPACE_LANES = 8


@dataclass(frozen=True)
class MemoryPlan:
    """How a load carved its budget (bytes), logged as ignis.runtime.vram_plan."""

    budget_bytes: int
    weights_bytes: int
    workspace_bytes: int
    kv_bytes: int
    block_size: int
    num_blocks: int
    host_kv_bytes: int
    num_host_blocks: int


EMPTY_PLAN = dict.fromkeys(MemoryPlan.__dataclass_fields__, 0)


def weights_bytes(cfg: ModelConfig, *, bytes_per_value: int = 4) -> int:
    """Bytes of every tensor the model's definition lists (a tied head counts once more:
    the numpy backend keeps [hidden, vocab] products apart from the embedding table)."""
    from engine.models import definition

    shapes = definition(cfg.arch).tensors(cfg)
    n = sum(_numel(s) for s in shapes.values())
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    return bytes_per_value * n


def workspace_bytes(cfg: ModelConfig, *, rows: int = WORKSPACE_LANES, logit_rows: int = WORKSPACE_LANES,
                    bytes_per_value: int = 4) -> int:  # fmt: skip
    """Activations of ``rows`` rows through one layer plus ``logit_rows`` rows of logits."""
    per_row = 4 * cfg.intermediate_size + 4 * cfg.hidden_size
    return bytes_per_value * (rows * per_row + logit_rows * cfg.vocab_size)


def dequant_scratch_bytes(cfg: ModelConfig) -> int:
    """bf16 bytes of a layer's largest matrix (q|k|v, o, gate|up, down): where the CUDA backend's
    prefill dequantizes a matrix kept in GGUF blocks for the GEMM (the weights count as stored)."""
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return 2 * max(qkv * hid, hid * cfg.num_heads * cfg.head_dim, 2 * inter * hid)


def kv_block_bytes(cfg: ModelConfig, block_size: int, *, bytes_per_value: int = 4) -> int:
    """K and V of ``block_size`` tokens across all layers."""
    return 2 * block_size * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_value


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- the numpy backend's host RAM plan, made before a load (and before a switch tears down) --


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
    """The numpy backend's plan: weights first, then working memory, then the KV pool
    takes the rest of the budget. ``problem`` says why it does not fit (None: it does)."""

    budget_bytes: int
    weights_bytes: int
    workspace_bytes: int
    kv_bytes: int
    min_kv_bytes: int
    available_bytes: int
    context_tokens: int  # the one sequence the pool must hold at least

    @property
    def problem(self) -> str | None:
        if self.kv_bytes < self.min_kv_bytes:
            return (
                f"host RAM plan: budget_bytes={self.budget_bytes} weights_bytes={self.weights_bytes} "
                f"workspace_bytes={self.workspace_bytes} leave kv_bytes={self.kv_bytes}, below the "
                f"min_kv_bytes={self.min_kv_bytes} one {self.context_tokens}-token sequence needs"
            )
        if self.weights_bytes + self.workspace_bytes > self.available_bytes:
            return (
                f"host RAM plan: weights_bytes={self.weights_bytes} + workspace_bytes={self.workspace_bytes} "
                f"exceed available_bytes={self.available_bytes} (MemAvailable plus the loaded model's plan)"
            )
        return None


def ram_plan(
    cfg: ModelConfig, *, ram_budget: int, kv_ram_budget: int, max_context: int, block_size: int, freed_bytes: int
) -> RamPlan:
    """The plan for loading ``cfg`` into ``ram_budget`` bytes (0: weights + workspace +
    ``kv_ram_budget``), against the host's available RAM plus ``freed_bytes`` (what the
    loaded model gives back at teardown)."""
    weights, work = weights_bytes(cfg), workspace_bytes(cfg)
    budget = ram_budget or weights + work + kv_ram_budget
    ctx = min(max_context, cfg.max_position)
    min_kv = math.ceil(ctx / block_size) * block_size * cfg.kv_bytes_per_token_fp32
    return RamPlan(budget, weights, work, budget - weights - work, min_kv, mem_available() + freed_bytes, ctx)
