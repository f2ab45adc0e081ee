"""Phi-3 (``Phi3ForCausalLM``): llama's block, with q|k|v and gate|up fused in the checkpoint.

Config: HF ``Phi3Config``, read as llama's. Refused: ``rope_scaling`` of any kind
(the 128k models' longrope / su scaling, issue 13) and ``partial_rotary_factor``
other than 1.0. ``sliding_window`` (2047 in Phi-3-mini-4k) caps ``max_position``
at the window: within it, sliding-window attention is plain causal attention,
which is what the block computes.

Tensors: safetensors ``self_attn.qkv_proj`` holds q, k, v stacked by rows and
``mlp.gate_up_proj`` gate then up; both are split into the canonical
projections as row views. llama.cpp names them ``blk.N.attn_qkv`` and
``blk.N.ffn_up`` (gate|up, ``[2 * intermediate, hidden]``) and leaves phi3's q/k
rows in HF order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.model_config import ModelConfig
from engine.models.base import TensorMap
from engine.models.llama import LLAMA_GGUF, Llama

_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")

PHI3_HF = TensorMap(layer={"self_attn.qkv_proj.weight": _QKV, "mlp.gate_up_proj.weight": _GATE_UP}, passthrough=True)
PHI3_GGUF = TensorMap(
    layer={
        **{k: v for k, v in LLAMA_GGUF.layer.items() if k != "ffn_gate.weight" and not k.endswith(".bias")},
        "attn_qkv.weight": _QKV,
        "ffn_up.weight": _GATE_UP,
    },
    globals=LLAMA_GGUF.globals,
    layer_prefix=LLAMA_GGUF.layer_prefix,
)


@dataclass(frozen=True)
class Phi3(Llama):
    hf_map: TensorMap = field(default=PHI3_HF, repr=False)
    gguf_map: TensorMap = field(default=PHI3_GGUF, repr=False)
    gguf_permuted_qk: bool = False

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            raise ValueError(f"phi3: rope_scaling {kind!r} is not supported (longrope / su scaling: issue 13)")
        partial = float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise ValueError(f"phi3: partial_rotary_factor {partial} is not supported (only 1.0)")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"phi3: hidden_act {config['hidden_act']!r} is not supported (only silu)")
        return _cap_at_window(super().config_from_hf(config, generation), config.get("sliding_window"))

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        if tensor_names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
            raise ValueError(
                "phi3: longrope scaling (rope_factors_long / rope_factors_short) is not supported (issue 13)"
            )
        cfg = super().config_from_gguf(meta, tensor_names)
        rotary = meta.get("phi3.rope.dimension_count")
        if rotary is not None and int(rotary) != cfg.head_dim:
            raise ValueError(f"phi3: rope over {rotary} of {cfg.head_dim} head dimensions is not supported")
        return _cap_at_window(cfg, meta.get("phi3.attention.sliding_window"))


def _cap_at_window(cfg: ModelConfig, window: int | None) -> ModelConfig:
    if window and int(window) < cfg.max_position:
        return replace(cfg, max_position=int(window))
    return cfg


PHI3 = Phi3("phi3", ("phi3",), ("phi3",))
