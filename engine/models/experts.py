"""Sparse-MoE checkpoints: expert tensors to the canonical per-expert names, and their shapes.

The canonical names of a sparse layer (``engine.models.ops.MoE``) are the router
``mlp.gate.weight`` ``[experts, hidden]`` and, for each expert e,
``mlp.experts.{e}.{gate,up,down}_proj.weight``. Checkpoints store experts three
ways, all split here into per-expert views (no copy):

* per expert, 2-D (Hub safetensors, and what transformers 5 writes back with
  ``save_pretrained``): already canonical for qwen3_moe; mixtral's names
  (``block_sparse_moe.experts.{e}.w1|w3|w2``, gate, up, down) are renamed by
  its definition;
* stacked, 3-D, as transformers 5 holds them in memory:
  ``mlp.experts.gate_up_proj`` ``[experts, 2 * inter, hidden]`` (gate rows
  first, then up) and ``mlp.experts.down_proj`` ``[experts, hidden, inter]``;
* llama.cpp's GGUF: ``blk.N.ffn_{gate,up,down}_exps.weight``, numpy view
  ``[experts, out, in]``, or in old files one 2-D tensor per expert,
  ``blk.N.ffn_{gate,up,down}.{e}.weight``.
"""

from __future__ import annotations

import re

import numpy as np

from engine.model_config import ModelConfig
from engine.models.base import LAYER_PREFIX

_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_HF_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_exps|\.(\d+))\.weight")

GGUF_ROUTER = "ffn_gate_inp.weight"  # blk.N.ffn_gate_inp.weight: the router, [experts, hidden]


def expert_name(layer: int | str, expert: int, proj: str) -> str:
    """Canonical name of one expert's projection (``proj``: gate_proj, up_proj, down_proj)."""
    return f"{LAYER_PREFIX}{layer}.mlp.experts.{expert}.{proj}.weight"


def sparse_layer_tensors(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Router and expert shapes ``[out, in]`` of sparse layer ``layer``."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    out = {f"{LAYER_PREFIX}{layer}.mlp.gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        out[expert_name(layer, e, "gate_proj")] = (i, h)
        out[expert_name(layer, e, "up_proj")] = (i, h)
        out[expert_name(layer, e, "down_proj")] = (h, i)
    return out


def split_hf_stacked(cfg: ModelConfig, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` as per-expert views;
    None for any other tensor."""
    m = _HF_STACKED.fullmatch(name)
    if m is None:
        return None
    layer, kind = m.groups()
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    want = (e, 2 * i, h) if kind == "gate_up_proj" else (e, h, i)
    if w.shape != want:
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {want}")
    if kind == "down_proj":
        return [(expert_name(layer, x, "down_proj"), w[x]) for x in range(e)]
    parts = []
    for x in range(e):
        parts += [(expert_name(layer, x, "gate_proj"), w[x, :i]), (expert_name(layer, x, "up_proj"), w[x, i:])]
    return parts


def is_gguf_experts(name: str) -> bool:
    """Whether ``name`` is a llama.cpp expert tensor (stacked ``_exps`` or one per expert)."""
    return _GGUF_EXPERTS.fullmatch(name) is not None


def split_gguf_experts(cfg: ModelConfig, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A llama.cpp expert tensor as canonical per-expert arrays (views of a stacked one);
    None for any other tensor."""
    m = _GGUF_EXPERTS.fullmatch(name)
    if m is None:
        return None
    layer, kind, single = m.groups()
    proj = _PROJ[kind]
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    rows, cols = (h, i) if kind == "down" else (i, h)
    if single is not None:
        if w.shape != (rows, cols):
            raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {(rows, cols)}")
        return [(expert_name(layer, int(single), proj), w)]
    if w.shape != (cfg.num_experts, rows, cols):
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {(cfg.num_experts, rows, cols)}")
    return [(expert_name(layer, x, proj), w[x]) for x in range(cfg.num_experts)]


def gguf_sparse_layers(tensor_names: set[str], num_layers: int) -> tuple[int, ...]:
    """The layers of a GGUF that carry a router (``blk.N.ffn_gate_inp.weight``)."""
    return tuple(n for n in range(num_layers) if f"blk.{n}.{GGUF_ROUTER}" in tensor_names)


def check_routing(arch: str, num_experts: int, top_k: int) -> None:
    """Refuse a routing no sparse layer can run: no experts, or more chosen than there are."""
    if num_experts < 1:
        raise ValueError(f"{arch}: num_experts {num_experts} (a sparse model needs at least one expert)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok {top_k} is not between 1 and num_experts ({num_experts})")
