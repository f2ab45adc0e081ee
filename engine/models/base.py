"""What every model definition provides (the contract backends and loaders rely on).

SKELETON: the loaders still parse configs themselves; the models helper moves
that here (config_from_hf / config_from_gguf / checkpoint name mapping).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.models.ops import Attention, Block, GatedMLP, Head, RMSNorm


@dataclass(frozen=True)
class ModelDefinition:
    name: str  # ModelConfig.arch
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]

    def block(self, cfg: ModelConfig) -> Block:
        return Block(
            attn_norm=RMSNorm("input_layernorm"),
            attention=Attention(qkv_bias=cfg.attention_bias),
            mlp_norm=RMSNorm("post_attention_layernorm"),
            mlp=GatedMLP("silu"),
        )

    def head(self, cfg: ModelConfig) -> Head:
        return Head()

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Canonical (HF llama) name -> shape ``[out, in]`` of every tensor a backend receives."""
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (cfg.vocab_size, h)
        for n in range(cfg.num_layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, q)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
            if cfg.attention_bias:
                out[p + "self_attn.q_proj.bias"] = (q,)
                out[p + "self_attn.k_proj.bias"] = (kv,)
                out[p + "self_attn.v_proj.bias"] = (kv,)
        return out
