"""gpt-oss (``GptOssForCausalLM``): attention with sinks over alternating windows, and a biased MoE.

Config: HF ``GptOssConfig``. ``layer_types`` (default: even layers
``sliding_attention``, odd ``full_attention``) with ``sliding_window`` (128);
yarn ``rope_scaling`` (or transformers 5's ``rope_parameters``; theta 150000
when absent); ``num_local_experts`` experts of ``intermediate_size``,
``num_experts_per_tok`` a token; ``swiglu_limit``. Refused: a ``swiglu_alpha``
other than 1.702 (the clamped SwiGLU's fixed gain), a rope scaling other than
yarn, a ``layer_types`` entry other than those two. GGUF: llama.cpp's
``gpt-oss.*`` metadata; its layers alternate the same way (its SWA pattern 2)
and its yarn keys carry no ``truncate``, which every gpt-oss config sets False.

Block: ``x += o_proj(attention(rope(q, k), v)) + o bias`` over
``input_layernorm(x)``, q/k/v with biases, each head's sink logit in the
softmax denominator, the window on sliding layers; then ``x += moe(h)`` over
``post_attention_layernorm(x)``: router ``mlp.gate`` with bias, top-k logits
softmaxed (= softmax, top-k, renormalise), experts with biases and
``swiglu_oai``. Head: ``model.norm`` then ``lm_head``.

Tensors: the checkpoint names the router ``mlp.router`` and stacks the experts
as transformers' fused parameters, ``[in, out]`` per expert:
``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]`` with gate and up interleaved
on the last axis (even columns gate, odd up), ``gate_up_proj_bias`` ``[E, 2I]``,
``down_proj`` ``[E, I, hidden]``, ``down_proj_bias`` ``[E, hidden]``; MXFP4
checkpoints reach this layout through the loader (``engine.loaders.mxfp4``), or,
kept as stored, come as ``Mxfp4Tensor`` stacks ``[E, out, in]`` (gate and up
interleaved on the rows), each expert's rows picked without dequantizing.
llama.cpp stacks them ``[E, out, in]`` as ``ffn_{gate,up,down}_exps`` (gate and
up already apart) with ``.bias`` ``[E, out]``, names the router
``ffn_gate_inp``, the sinks ``attn_sinks`` and the second norm
``post_attention_norm``; its q/k rows are in HF order (NEOX rope).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from engine.loaders.mxfp4 import Mxfp4Tensor
from engine.model_config import ModelConfig
from engine.models.base import TensorMap, split_fused
from engine.models.llama import LLAMA_GGUF, Llama
from engine.models.ops import Attention, Block, MoE, RMSNorm

SWIGLU_ALPHA = 1.702
LAYER_TYPES = ("sliding_attention", "full_attention")
# GptOssConfig's rope when config.json has none.
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # fmt: skip

_ROUTER = {"mlp.router.weight": ("mlp.gate.weight",), "mlp.router.bias": ("mlp.gate.bias",)}
GPT_OSS_HF = TensorMap(layer=_ROUTER, passthrough=True)
GPT_OSS_GGUF = TensorMap(
    layer={
        **{k: v for k, v in LLAMA_GGUF.layer.items() if not k.startswith("ffn_")},
        "post_attention_norm.weight": ("post_attention_layernorm.weight",),
        "attn_output.bias": ("self_attn.o_proj.bias",),
        "attn_sinks.weight": ("self_attn.sinks",),
        "ffn_gate_inp.weight": ("mlp.gate.weight",),
        "ffn_gate_inp.bias": ("mlp.gate.bias",),
    },
    globals=LLAMA_GGUF.globals,
    layer_prefix=LLAMA_GGUF.layer_prefix,
)
# llama.cpp's stacked experts [E, out, in] (biases [E, out]) -> each expert's canonical suffix.
GGUF_EXPERTS = {
    f"ffn_{p}_exps.{kind}": f"{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")
}


@dataclass(frozen=True)
class GptOss(Llama):
    hf_map: TensorMap = field(default=GPT_OSS_HF, repr=False)
    gguf_map: TensorMap = field(default=GPT_OSS_GGUF, repr=False)
    qkv_bias_default: bool = True
    gguf_permuted_qk: bool = False

    # --- config ------------------------------------------------------------------------

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        alpha = float(config.get("swiglu_alpha", SWIGLU_ALPHA))
        if alpha != SWIGLU_ALPHA:
            raise ValueError(f"gpt_oss: swiglu_alpha {alpha} is not supported (only {SWIGLU_ALPHA})")
        config = dict(config)
        rope = config.get("rope_parameters") or {}
        config.setdefault("rope_theta", rope.get("rope_theta", 150000.0))
        if not config.get("rope_scaling") and not rope:
            config["rope_scaling"] = DEFAULT_YARN
        cfg = super().config_from_hf(config, generation)
        n = cfg.num_layers
        types = tuple(config.get("layer_types") or (LAYER_TYPES[i % 2] for i in range(n)))
        if len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"gpt_oss: layer_types {list(types)} must give each of {n} layers one of {LAYER_TYPES}")
        window = config.get("sliding_window", 128)
        return self._finish(
            cfg, window, types, int(config["num_local_experts"]), int(config["num_experts_per_tok"]),
            cfg.intermediate_size, float(config.get("swiglu_limit", 7.0)),
        )  # fmt: skip

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]

        def key(name, default=None):
            return meta.get(f"{arch}.{name}", default)

        width = key("expert_feed_forward_length", key("feed_forward_length"))
        cfg = super().config_from_gguf({f"{arch}.feed_forward_length": width, **meta}, tensor_names)
        kind = key("rope.scaling.type")
        scaling = None
        if kind == "yarn":
            scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")), "truncate": False,
                       "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}  # fmt: skip
            for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                     ("yarn_attn_factor", "attention_factor")):  # fmt: skip
                if key(f"rope.scaling.{gguf_key}") is not None:
                    scaling[hf_key] = float(key(f"rope.scaling.{gguf_key}"))
        elif kind not in (None, "none"):
            raise ValueError(f"gpt_oss: {arch}.rope.scaling.type {kind!r} is not supported (only yarn)")
        types = tuple(LAYER_TYPES[i % 2] for i in range(cfg.num_layers))
        return self._finish(
            replace(cfg, rope_scaling=scaling), key("attention.sliding_window"), types,
            int(key("expert_count")), int(key("expert_used_count")), int(width), 7.0,
        )  # fmt: skip

    def _finish(self, cfg, window, types, experts, per_token, width, limit) -> ModelConfig:
        kind = (cfg.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("yarn", "default"):
            raise ValueError(f"gpt_oss: rope_scaling.rope_type {kind!r} is not supported (only yarn)")
        return replace(
            cfg, sliding_window=int(window) if window else None, layer_types=types, num_experts=experts,
            num_experts_per_tok=per_token, moe_intermediate_size=width, params={"swiglu_limit": limit},
        )  # fmt: skip

    # --- what the model computes -------------------------------------------------------

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        bias = cfg.attention_bias
        return Block(
            attn_norm=RMSNorm("input_layernorm"),
            attention=Attention(qkv_bias=bias, o_bias=bias, sliding_window=cfg.layer_window(layer), sinks=True),
            mlp_norm=RMSNorm("post_attention_layernorm"),
            mlp=MoE(
                cfg.num_experts,
                cfg.num_experts_per_tok,
                norm_topk_prob=True,
                router_bias=True,
                expert_bias=True,
                act="swiglu_oai",
                swiglu_limit=cfg.params.get("swiglu_limit", 7.0),
            ),  # fmt: skip
        )

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, i, d, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim, cfg.num_experts
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (cfg.vocab_size, h)
        for n in range(cfg.num_layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (h,)
            shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
            for proj, shape in shapes.items():
                out[f"{p}self_attn.{proj}.weight"] = shape
                if cfg.attention_bias:
                    out[f"{p}self_attn.{proj}.bias"] = shape[:1]
            out[p + "self_attn.sinks"] = (cfg.num_heads,)
            out[p + "mlp.gate.weight"], out[p + "mlp.gate.bias"] = (e, h), (e,)
            for x in range(e):
                ex = f"{p}mlp.experts.{x}."
                out[ex + "gate_proj.weight"] = out[ex + "up_proj.weight"] = (i, h)
                out[ex + "gate_proj.bias"] = out[ex + "up_proj.bias"] = (i,)
                out[ex + "down_proj.weight"], out[ex + "down_proj.bias"] = (h, i), (h,)
        return out

    # --- checkpoint names --------------------------------------------------------------

    def from_hf(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, w in weights.items():
            prefix, sep, fused = name.partition("mlp.experts.")
            if sep and "." not in fused:
                out.update(_split_hf_experts(cfg, prefix + sep, fused, w))
            else:
                out.update(split_fused(cfg, self, self.hf_map, name, w))
        return out

    def from_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        layer, suffix = _gguf_expert(name)
        if suffix is None:
            yield from super().from_gguf(cfg, name, w)
            return
        _check_experts(cfg, name, w)
        for e in range(cfg.num_experts):
            yield f"model.layers.{layer}.mlp.experts.{e}.{suffix}", w[e]

    def is_known_gguf(self, name: str) -> bool:
        return _gguf_expert(name)[1] is not None or super().is_known_gguf(name)


def _gguf_expert(name: str) -> tuple[str, str | None]:
    """``(layer, canonical expert suffix)`` of a llama.cpp stacked-expert tensor, else ``("", None)``."""
    head, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if head == "blk" and layer.isdigit() and suffix in GGUF_EXPERTS:
        return layer, GGUF_EXPERTS[suffix]
    return "", None


def _check_experts(cfg: ModelConfig, name: str, w: np.ndarray | Mxfp4Tensor) -> None:
    if w.shape[0] != cfg.num_experts:
        raise ValueError(f"{name}: {w.shape[0]} experts stacked, expected {cfg.num_experts}")


def _split_hf_experts(
    cfg: ModelConfig, prefix: str, fused: str, w: np.ndarray | Mxfp4Tensor
) -> dict[str, np.ndarray | Mxfp4Tensor]:
    """transformers' fused experts ``[E, in, out]`` (gate|up interleaved), or an ``Mxfp4Tensor``
    stack ``[E, out, in]``, -> per-expert ``[out, in]``."""
    _check_experts(cfg, prefix + fused, w)
    out: dict[str, np.ndarray | Mxfp4Tensor] = {}
    for e in range(cfg.num_experts):
        p = f"{prefix}{e}."
        if fused == "gate_up_proj" and isinstance(w, Mxfp4Tensor):  # gate|up interleaved on the rows
            out[p + "gate_proj.weight"] = w[e].rows(slice(0, None, 2))
            out[p + "up_proj.weight"] = w[e].rows(slice(1, None, 2))
        elif fused == "gate_up_proj":
            out[p + "gate_proj.weight"] = np.ascontiguousarray(w[e][:, 0::2].T)
            out[p + "up_proj.weight"] = np.ascontiguousarray(w[e][:, 1::2].T)
        elif fused == "gate_up_proj_bias":
            out[p + "gate_proj.bias"], out[p + "up_proj.bias"] = w[e][0::2], w[e][1::2]
        elif fused == "down_proj":
            out[p + "down_proj.weight"] = w[e] if isinstance(w, Mxfp4Tensor) else np.ascontiguousarray(w[e].T)
        elif fused == "down_proj_bias":
            out[p + "down_proj.bias"] = w[e]
        else:
            raise ValueError(f"gpt_oss: unknown expert tensor {prefix + fused}")
    return out


GPT_OSS = GptOss("gpt_oss", ("gpt_oss",), ("gpt-oss",))
