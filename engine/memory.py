"""The memory plan: weights, workspace, the KV pool and the host tier, in bytes.

One module for both backends and the switch precheck, so the figure a switch
is refused on is the one a load then carves: weights first, then the working
memory of one round (``workspace_bytes``, the one formula), then the KV pool
takes what the budget leaves, and the host tier holds swapped pages.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def kv_block_bytes(cfg: ModelConfig, block_size: int, *, bytes_per_value: int = 4) -> int:
    """K and V of ``block_size`` tokens across all layers."""
    return 2 * block_size * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_value


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
