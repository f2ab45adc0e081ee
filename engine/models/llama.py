"""llama and mistral: the pre-norm decoder the other families vary.

Config: HF ``LlamaConfig`` / ``MistralConfig`` fields (``rope_theta`` at the top
or, in transformers 5, under ``rope_parameters``; llama3 and linear
``rope_scaling``; an explicit ``head_dim``); GGUF ``{arch}.*`` metadata.
mistral's ``sliding_window`` (Mistral-7B-v0.1: 4096; null in later ones)
windows every layer, as transformers masks it (``ModelConfig.sliding_window``
with ``layer_types`` empty); HF ``LlamaConfig`` has none. llama.cpp converts
Mistral checkpoints to its ``llama`` architecture, so a GGUF's window is
``{arch}.attention.sliding_window`` for both (0 or absent: none). A window
no shorter than ``max_position`` never masks anything and is dropped.

Block: ``x += o_proj(attention(rope(q, k), v))`` over ``input_layernorm(x)``,
then ``x += down(silu(gate(h)) * up(h))`` over ``post_attention_layernorm(x)``,
all RMSNorm; the head is ``model.norm`` then ``lm_head`` (or the tied
embedding).

Tensors: safetensors names are the canonical ones. llama.cpp names them
``token_embd``, ``blk.N.attn_q`` ... (``LLAMA_GGUF``), and its converter
permutes the rows of ``attn_q`` / ``attn_k`` for llama and mistral (undone here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from engine.model_config import ModelConfig
from engine.models.base import ModelDefinition, TensorMap, eos_ids, unpermute_rows
from engine.models.ops import Attention, Block, GatedMLP, Head, RMSNorm

LLAMA_GGUF = TensorMap(
    layer={
        "attn_norm.weight": ("input_layernorm.weight",),
        "ffn_norm.weight": ("post_attention_layernorm.weight",),
        "attn_q.weight": ("self_attn.q_proj.weight",),
        "attn_k.weight": ("self_attn.k_proj.weight",),
        "attn_v.weight": ("self_attn.v_proj.weight",),
        "attn_output.weight": ("self_attn.o_proj.weight",),
        "attn_q.bias": ("self_attn.q_proj.bias",),
        "attn_k.bias": ("self_attn.k_proj.bias",),
        "attn_v.bias": ("self_attn.v_proj.bias",),
        "ffn_gate.weight": ("mlp.gate_proj.weight",),
        "ffn_up.weight": ("mlp.up_proj.weight",),
        "ffn_down.weight": ("mlp.down_proj.weight",),
    },
    globals={
        "token_embd.weight": ("model.embed_tokens.weight",),
        "output_norm.weight": ("model.norm.weight",),
        "output.weight": ("lm_head.weight",),
    },
    layer_prefix="blk.",
)


@dataclass(frozen=True)
class Llama(ModelDefinition):
    """The llama family; ``qkv_bias_default`` is what a config.json without ``attention_bias`` means."""

    gguf_map: TensorMap = field(default=LLAMA_GGUF, repr=False)
    qkv_bias_default: bool = False
    gguf_permuted_qk: bool = True  # llama.cpp's converter permutes q/k rows for this arch
    hf_sliding_window: bool = False  # config.json's sliding_window windows every layer (mistral)
    gguf_sliding_window: bool = False  # {arch}.attention.sliding_window windows every layer (llama, mistral)
    gguf_moe: str | None = None  # the definition of a GGUF of this arch with experts (mixtral's say "llama")

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        eos = (generation or {}).get("eos_token_id", config.get("eos_token_id"))
        # transformers 5 keeps rope_theta under rope_parameters; older configs have it at the top.
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        cfg = ModelConfig(
            arch=self.name,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", self.qkv_bias_default)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids(eos),
        )
        return with_window(cfg, config.get("sliding_window")) if self.hf_sliding_window else cfg

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]
        if self.gguf_moe and meta.get(f"{arch}.expert_count"):
            from engine.models import definition  # here: engine.models imports this module

            return definition(self.gguf_moe).config_from_gguf(meta, tensor_names)

        def key(name, default=None):
            return meta.get(f"{arch}.{name}", default)

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        vocab = key("vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", [])) or None
        rope_scaling = None
        if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        cfg = ModelConfig(
            arch=self.name,
            vocab_size=int(vocab) if vocab is not None else 0,
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", 0) or hidden // num_heads),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position=int(key("context_length", 8192)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids(meta.get("tokenizer.ggml.eos_token_id")),
        )
        return with_window(cfg, key("attention.sliding_window")) if self.gguf_sliding_window else cfg

    def relayout_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> np.ndarray:
        if self.gguf_permuted_qk and (".q_proj." in name or ".k_proj." in name):
            return unpermute_rows(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        return w

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        return Block(
            attn_norm=RMSNorm("input_layernorm"),
            attention=Attention(qkv_bias=cfg.attention_bias, sliding_window=cfg.layer_window(layer)),
            mlp_norm=RMSNorm("post_attention_layernorm"),
            mlp=GatedMLP("silu"),
        )

    def head(self, cfg: ModelConfig) -> Head:
        return Head()

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def with_window(cfg: ModelConfig, window: int | None) -> ModelConfig:
    """``cfg`` with every layer sliding over ``window`` (unchanged for none, 0, or one that never masks)."""
    if window and int(window) < cfg.max_position:
        return replace(cfg, sliding_window=int(window), layer_types=())
    return cfg


LLAMA = Llama("llama", ("llama",), ("llama",), gguf_sliding_window=True, gguf_moe="mixtral")
MISTRAL = Llama("mistral", ("mistral",), ("mistral",), hf_sliding_window=True, gguf_sliding_window=True)
