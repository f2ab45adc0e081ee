"""mixtral: mistral's block with every MLP a sparse mixture of experts.

Config: HF ``MixtralConfig``: ``num_local_experts`` experts (8) of width
``intermediate_size``, the top ``num_experts_per_tok`` (2) of a softmax over
them, always renormalised; ``rope_theta`` absent means 1e6 (transformers'
default for mixtral); ``sliding_window`` when set slides every layer.
``hidden_act`` other than silu is refused.

Tensors: Hub checkpoints, and transformers 5's ``save_pretrained``, name the
router ``block_sparse_moe.gate`` and expert e's projections
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) and ``w2`` (down),
renamed here to the canonical ``mlp.gate`` / ``mlp.experts.{e}.*_proj``;
transformers 5's in-memory layout (``mlp.gate``, stacked
``mlp.experts.gate_up_proj`` / ``down_proj``) is split as well
(``engine.models.experts``).

GGUF: llama.cpp converts mixtral as architecture "llama" (q/k rows permuted
as for llama) with ``llama.expert_count`` / ``expert_used_count`` metadata and
``blk.N.ffn_gate_inp`` plus ``ffn_{gate,up,down}_exps`` (or, in old files, one
``ffn_{gate,up,down}.{e}`` per expert); llama's definition hands such a file to
this one (``Llama.gguf_moe``). A window is read as for mistral: config.json's
``sliding_window``, a GGUF's ``llama.attention.sliding_window`` (``llama.with_window``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.model_config import ModelConfig
from engine.models import experts
from engine.models.base import TensorMap
from engine.models.llama import LLAMA_GGUF, Llama
from engine.models.ops import Block, MoE
from engine.models.qwen3 import check_hidden_act

MIXTRAL_GGUF = dataclasses.replace(LLAMA_GGUF, layer={**LLAMA_GGUF.layer, experts.GGUF_ROUTER: ("mlp.gate.weight",)})

_HUB_NAME = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)")
_HUB_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_hf_name(name: str) -> str:
    """A mixtral Hub tensor name in canonical naming (others unchanged)."""
    m = _HUB_NAME.fullmatch(name)
    if m is None:
        return name
    prefix, _, expert, w = m.groups()
    if expert is None:
        return prefix + "mlp.gate.weight"
    return f"{prefix}mlp.experts.{expert}.{_HUB_PROJ[w]}.weight"


@dataclass(frozen=True)
class Mixtral(Llama):
    gguf_map: TensorMap = field(default=MIXTRAL_GGUF, repr=False)

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        check_hidden_act(self.name, config)
        if "rope_theta" not in config and "rope_theta" not in (config.get("rope_parameters") or {}):
            config = {**config, "rope_theta": 1e6}
        cfg = super().config_from_hf(config, generation)  # with its window (hf_sliding_window, as mistral)
        return self._with_experts(
            cfg, int(config.get("num_local_experts", 8)), int(config.get("num_experts_per_tok", 2)), cfg.intermediate_size
        )  # fmt: skip

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]
        cfg = super().config_from_gguf(meta, tensor_names)
        if tensor_names:
            dense = set(range(cfg.num_layers)) - set(experts.gguf_sparse_layers(tensor_names, cfg.num_layers))
            if dense:
                raise ValueError(f"{self.name}: blk.{min(dense)}.{experts.GGUF_ROUTER} missing (every layer is sparse)")
        width = meta.get(f"{arch}.expert_feed_forward_length") or cfg.intermediate_size
        return self._with_experts(
            cfg, int(meta.get(f"{arch}.expert_count", 0)), int(meta.get(f"{arch}.expert_used_count", 0)), int(width)
        )  # fmt: skip

    def _with_experts(self, cfg: ModelConfig, num_experts: int, top_k: int, width: int) -> ModelConfig:
        experts.check_routing(self.name, num_experts, top_k)
        return dataclasses.replace(cfg, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width)

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        return dataclasses.replace(super().block(cfg, layer), mlp=MoE(cfg.num_experts, cfg.num_experts_per_tok))

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        out = super().tensors(cfg)
        for n in range(cfg.num_layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del out[f"model.layers.{n}.mlp.{proj}.weight"]
            out.update(experts.sparse_layer_tensors(cfg, n))
        return out

    def from_hf(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, w in weights.items():
            parts = experts.split_hf_stacked(cfg, name, w)
            out.update(super().from_hf(cfg, {canonical_hf_name(name): w}) if parts is None else parts)
        return out

    def from_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        parts = experts.split_gguf_experts(cfg, name, w)
        if parts is None:
            return super().from_gguf(cfg, name, w)
        return iter(parts)

    def is_known_gguf(self, name: str) -> bool:
        return experts.is_gguf_experts(name) or super().is_known_gguf(name)


MIXTRAL = Mixtral("mixtral", ("mixtral",), (), hf_sliding_window=True, gguf_sliding_window=True)
