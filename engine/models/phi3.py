"""Phi-3 and Phi-4 dense (``Phi3ForCausalLM``): llama's block, with q|k|v and gate|up fused in the checkpoint.

Config: HF ``Phi3Config``, read as llama's, plus:

* ``rope_scaling`` (or transformers 5's ``rope_parameters``) of type
  ``longrope`` (``su``, its old name): ``short_factor``, ``long_factor``,
  ``original_max_position_embeddings`` (the top-level field wins, as in
  transformers), optional ``factor`` / ``attention_factor``; which factor set
  a load uses is ``engine.models.rope``'s rule (chosen once, by the served
  context). Any other scaling type is refused.
* ``partial_rotary_factor`` < 1 (Phi-4-mini: 0.75): rope turns the first
  ``int(head_dim * factor)`` dims of each head (``Rope.rotary_dim``, kept in
  ``params["rotary_dim"]``).
* ``sliding_window`` (2047 in Phi-3-mini-4k): transformers masks every layer
  to it (``i - j < window``), so every layer slides here too
  (``ModelConfig.sliding_window``, ``layer_types`` empty); a window no
  shorter than ``max_position`` never masks anything and is dropped
  (``llama.with_window``).

Tensors: safetensors ``self_attn.qkv_proj`` holds q, k, v stacked by rows and
``mlp.gate_up_proj`` gate then up; both are split into the canonical
projections as row views. llama.cpp names them ``blk.N.attn_qkv`` and
``blk.N.ffn_up`` (gate|up, ``[2 * intermediate, hidden]``) and leaves phi3's q/k
rows in HF order. Its longrope GGUFs carry the factors as tensors
``rope_factors_long`` / ``rope_factors_short`` (read by the GGUF loader into
``rope_scaling``) beside ``phi3.rope.scaling.original_context_length`` and
``phi3.rope.scaling.attn_factor``; ``phi3.rope.dimension_count`` is the rotary
dim and ``phi3.attention.sliding_window`` 0 means none (Phi-4).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.model_config import ModelConfig
from engine.models.base import TensorMap
from engine.models.llama import LLAMA_GGUF, Llama
from engine.models.ops import Block, Rope

_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_LONGROPE = ("longrope", "su")

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
    hf_sliding_window: bool = True
    gguf_sliding_window: bool = True  # phi3.attention.sliding_window; llama.cpp writes 0 for Phi-4 (none)

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"phi3: hidden_act {config['hidden_act']!r} is not supported (only silu)")
        cfg = super().config_from_hf(config, generation)
        rope = config.get("rope_parameters") or {}
        partial = float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
        if not 0.0 < partial <= 1.0:
            raise ValueError(f"phi3: partial_rotary_factor {partial} is out of (0, 1]")
        scaling = None
        if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] != "default":
            scaling = {k: v for k, v in cfg.rope_scaling.items() if k not in ("type", "partial_rotary_factor")}
            if scaling["rope_type"] not in _LONGROPE:
                raise ValueError(f"phi3: rope_scaling {scaling['rope_type']!r} is not supported (longrope / su only)")
            missing = [k for k in ("short_factor", "long_factor") if k not in scaling]
            if missing:
                raise ValueError(f"phi3: rope_scaling longrope lacks {', '.join(missing)}")
            original = config.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
            # Phi3Config's own default for a config.json without the field.
            scaling.update(rope_type="longrope", original_max_position_embeddings=int(original or 4096))
            # transformers' attention factor follows the checkpoint's max_position_embeddings: pinned
            # here, so a load that serves a shorter context changes the factor set, never the factor.
            if scaling.get("factor") is None:
                scaling["factor"] = cfg.max_position / scaling["original_max_position_embeddings"]
        return replace(cfg, rope_scaling=scaling, params={**cfg.params, "rotary_dim": int(cfg.head_dim * partial)})

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        cfg = super().config_from_gguf(meta, tensor_names)
        rotary = int(meta.get("phi3.rope.dimension_count", cfg.head_dim))
        if not 0 < rotary <= cfg.head_dim or rotary % 2:
            raise ValueError(f"phi3: phi3.rope.dimension_count {rotary} does not fit head_dim {cfg.head_dim}")
        scaling = None
        if tensor_names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
            # The factors themselves are tensors: the GGUF loader adds them (short_factor, long_factor).
            original = meta.get("phi3.rope.scaling.original_context_length")
            if original is None:
                raise ValueError("phi3: rope_factors tensors without phi3.rope.scaling.original_context_length")
            scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
            if meta.get("phi3.rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
        return replace(cfg, rope_scaling=scaling, params={**cfg.params, "rotary_dim": rotary})

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        block = super().block(cfg, layer)
        rotary = cfg.params.get("rotary_dim", cfg.head_dim)
        if rotary == cfg.head_dim:
            return block
        return replace(block, attention=replace(block.attention, rope=Rope(rotary_dim=rotary)))


PHI3 = Phi3("phi3", ("phi3",), ("phi3",))
