"""gemma2 and gemma3 (text): llama's attention with gemma's norms, GeGLU and scalings.

Block (both): every RMSNorm scales by ``1 + w`` in float32; "sandwich" norms:
``x += post_attention_layernorm(attention(input_layernorm(x)))`` (a post-norm
here, not llama's pre-MLP norm), then ``x += post_feedforward_layernorm(
mlp(pre_feedforward_layernorm(x)))``; the MLP is GeGLU with tanh GELU
(``hidden_activation`` "gelu_pytorch_tanh"); embeddings are scaled by
``sqrt(hidden)`` (float32, as transformers' ``embed_scale`` buffer), scores by
``query_pre_attn_scalar ** -0.5``; the embedding is the LM head unless the
checkpoint has one. Layers slide by ``layer_types`` (default: gemma2 every
other one from the first, gemma3 five of each ``sliding_window_pattern`` = 6).

gemma2 soft-caps the attention scores (``attn_logit_softcapping``) and the
final logits (``final_logit_softcapping``). gemma3 adds q/k norms (``1 + w``),
drops the attention soft-cap (refused if set: transformers ignores it and
llama.cpp's converter asserts it absent), soft-caps the logits only if
configured, and ropes its sliding layers with their own base
(``rope_local_base_freq`` / ``rope_parameters.sliding_attention``), unscaled,
and its full layers with ``rope_theta`` and ``rope_scaling`` (linear factor 8
on the 4B+ models). A multimodal ``gemma3`` config.json serves its text model:
``text_config`` (missing fields take ``Gemma3TextConfig``'s defaults, as
transformers does) and the ``language_model`` weights; the vision tower is
never read. A ``final_logit_softcapping`` there is refused: transformers'
``Gemma3ForConditionalGeneration`` head never applies it (real ones are null).

GGUF (llama.cpp archs "gemma2" / "gemma3"): ``attn_norm``,
``post_attention_norm``, ``ffn_norm`` (the pre-MLP norm), ``post_ffw_norm``,
``attn_{q,k}_norm``, ``output_norm``, ``token_embd``. llama.cpp's converter
adds 1 to every ``*norm.weight`` so ggml can run a plain RMSNorm; that is
undone here. q/k rows keep HF order (a NEOX-rope arch: no permutation). What
llama.cpp's loader hard-codes rather than reads, and so is followed here:
``query_pre_attn_scalar`` is ``hidden / heads`` for the 27B models (46 layers
for gemma2, 62 for gemma3) and ``head_dim`` otherwise; gemma2 slides every
other layer from the first with a default window of 4096 and soft-caps 50 / 30
unless ``{arch}.attn_logit_softcapping`` / ``final_logit_softcapping`` say
otherwise; gemma3 slides five layers of each six (none without
``attention.sliding_window``) with a local rope base of 10000. A file that
stores ``attention.sliding_window_pattern`` or ``rope.freq_base_swa`` (the
converter writes neither for gemma) is read as those keys mean elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from engine.model_config import ModelConfig
from engine.models.base import ModelDefinition, TensorMap, eos_ids
from engine.models.llama import LLAMA, LLAMA_GGUF
from engine.models.ops import Attention, Block, Embedding, GatedMLP, Head, QKNorm, RMSNorm, Rope

SLIDING, FULL = "sliding_attention", "full_attention"

GEMMA_GGUF = TensorMap(
    layer={
        **{k: v for k, v in LLAMA_GGUF.layer.items() if k != "ffn_norm.weight"},
        "attn_output.bias": ("self_attn.o_proj.bias",),
        "post_attention_norm.weight": ("post_attention_layernorm.weight",),
        "ffn_norm.weight": ("pre_feedforward_layernorm.weight",),
        "post_ffw_norm.weight": ("post_feedforward_layernorm.weight",),
        "attn_q_norm.weight": ("self_attn.q_norm.weight",),
        "attn_k_norm.weight": ("self_attn.k_norm.weight",),
    },
    globals=LLAMA_GGUF.globals,
    layer_prefix=LLAMA_GGUF.layer_prefix,
)

# Gemma2Config / Gemma3TextConfig defaults (transformers 5) for fields a config.json leaves out.
_COMMON = {
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1,
    "tie_word_embeddings": True, "attention_bias": False, "layer_types": None, "use_bidirectional_attention": False,
}  # fmt: skip
_DEFAULTS = {
    "gemma2": {**_COMMON, "vocab_size": 256000, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3": {**_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072, "attn_logit_softcapping": None,
               "final_logit_softcapping": None, "sliding_window_pattern": 6},
}  # fmt: skip
_LOCAL_THETA, _GLOBAL_THETA = 10000.0, {"gemma2": 10000.0, "gemma3": 1_000_000.0}


@dataclass(frozen=True)
class Gemma(ModelDefinition):
    """gemma2 (``qk_norm`` False) or gemma3 (q/k norms, a local rope for sliding layers)."""

    gguf_map: TensorMap = field(default=GEMMA_GGUF, repr=False)
    qk_norm: bool = False
    pattern: int = 2  # llama.cpp's hard-coded sliding pattern; HF's default when layer_types is absent
    layers_27b: int = 46  # llama.cpp's n_layer of the 27B model (its query_pre_attn_scalar rule)

    # --- config ------------------------------------------------------------------------

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        if "text_config" in config:  # Gemma3ForConditionalGeneration ("gemma3"): its text model only
            top = config
            config = {k: top[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in top}
            config.update(top.get("text_config") or {})
            if config.get("final_logit_softcapping") is not None:  # its head never applies it
                raise ValueError("gemma3: text_config.final_logit_softcapping is not supported in a multimodal gemma3")
        d = _DEFAULTS[self.name]

        def get(name):
            return config[name] if name in config else d[name]

        if get("hidden_activation") != "gelu_pytorch_tanh":
            raise ValueError(f"{self.name}: hidden_activation {get('hidden_activation')!r} is not supported")
        if get("use_bidirectional_attention"):
            raise ValueError(f"{self.name}: use_bidirectional_attention is not supported (causal only)")
        if self.qk_norm and get("attn_logit_softcapping") is not None:
            raise ValueError(f"{self.name}: attn_logit_softcapping is not supported (transformers ignores it)")
        num_layers, num_heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
        theta, scaling, local_theta = self._rope_from_hf(config)
        params = {
            "query_pre_attn_scalar": float(get("query_pre_attn_scalar")),
            "attn_logit_softcapping": _opt_float(get("attn_logit_softcapping")),
            "final_logit_softcapping": _opt_float(get("final_logit_softcapping")),
        }
        if self.qk_norm:
            params["rope_local_base_freq"] = local_theta
        layer_types = get("layer_types")
        if layer_types is None:  # gemma2 has no sliding_window_pattern
            pattern = config.get("sliding_window_pattern", self.pattern) if self.qk_norm else self.pattern
            layer_types = _pattern(num_layers, int(pattern))
        window = get("sliding_window")
        eos = (generation or {}).get("eos_token_id", get("eos_token_id"))
        return ModelConfig(
            arch=self.name,
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads") or num_heads),
            head_dim=int(get("head_dim") or int(get("hidden_size")) // num_heads),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(get("max_position_embeddings")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=bool(get("attention_bias")),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=eos_ids(eos),
            sliding_window=None if window is None else int(window),
            layer_types=_check_layer_types(tuple(layer_types), num_layers, "layer_types"),
            params=params,
        )

    def _rope_from_hf(self, config: dict) -> tuple[float, dict | None, float]:
        """``(theta, scaling, local theta)`` from transformers 5's ``rope_parameters`` (gemma3: one
        dict per layer type) or the older flat ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
        rope = config.get("rope_parameters") or {}
        per_type = FULL in rope or SLIDING in rope
        full = (rope.get(FULL) or {}) if per_type else rope
        local = (rope.get(SLIDING) or {}) if per_type else {}
        theta = float(full.get("rope_theta", config.get("rope_theta", _GLOBAL_THETA[self.name])))
        scaling = _linear_scaling(self.name, config.get("rope_scaling") or full, "rope_scaling")
        local_theta = float(local.get("rope_theta", config.get("rope_local_base_freq", _LOCAL_THETA)))
        if _linear_scaling(self.name, local, "rope_parameters.sliding_attention") is not None:
            raise ValueError(f"{self.name}: rope scaling on the sliding layers is not supported")
        return theta, scaling, local_theta

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]

        def key(name, default=None):
            return meta.get(f"{arch}.{name}", default)

        kind = key("rope.scaling.type")
        if kind not in (None, "none", "linear"):
            raise ValueError(f"{arch}: {arch}.rope.scaling.type {kind!r} is not supported (only linear)")
        cfg = LLAMA.config_from_gguf(meta, tensor_names)
        rotary = key("rope.dimension_count")
        if rotary is not None and int(rotary) != cfg.head_dim:
            raise ValueError(f"{arch}: {arch}.rope.dimension_count {rotary} is not supported (only head_dim)")
        big = cfg.num_layers == self.layers_27b
        params = {"query_pre_attn_scalar": float(cfg.hidden_size // cfg.num_heads if big else cfg.head_dim)}
        if self.qk_norm:
            if key("attn_logit_softcapping") is not None:
                raise ValueError(f"{arch}: {arch}.attn_logit_softcapping is not supported for gemma3")
            window = key("attention.sliding_window")
            params["attn_logit_softcapping"] = None
            params["final_logit_softcapping"] = _opt_float(key("final_logit_softcapping"))
            params["rope_local_base_freq"] = float(key("rope.freq_base_swa", _LOCAL_THETA))
        else:
            window = key("attention.sliding_window", 4096)
            params["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
            params["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0))
        pattern = key("attention.sliding_window_pattern", self.pattern)
        if not window:  # llama.cpp: no window stored, no sliding layers
            window, layer_types = None, (FULL,) * cfg.num_layers
        elif isinstance(pattern, list):  # per layer, true for a sliding one
            layer_types = tuple(SLIDING if p else FULL for p in pattern)
        else:
            layer_types = _pattern(cfg.num_layers, int(pattern))
        return replace(
            cfg,
            arch=self.name,
            sliding_window=None if window is None else int(window),
            layer_types=_check_layer_types(layer_types, cfg.num_layers, f"{arch}.attention.sliding_window_pattern"),
            params=params,
        )

    # --- what the model computes -------------------------------------------------------

    def embedding(self, cfg: ModelConfig) -> Embedding:
        return Embedding(scale=math.sqrt(cfg.hidden_size))

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        p = cfg.params
        rope = Rope()
        if self.qk_norm and cfg.layer_types[layer] == SLIDING:
            rope = Rope(theta=p["rope_local_base_freq"], scaled=False)
        return Block(
            attn_norm=RMSNorm("input_layernorm", plus_one=True),
            attention=Attention(
                rope=rope,
                qkv_bias=cfg.attention_bias,
                o_bias=cfg.attention_bias,
                qk_norm=QKNorm(plus_one=True) if self.qk_norm else None,
                scale=p["query_pre_attn_scalar"] ** -0.5,
                softcap=p["attn_logit_softcapping"],
                sliding_window=cfg.layer_window(layer),
            ),
            mlp_norm=RMSNorm("pre_feedforward_layernorm", plus_one=True),
            mlp=GatedMLP("gelu_tanh"),
            attn_post_norm=RMSNorm("post_attention_layernorm", plus_one=True),
            mlp_post_norm=RMSNorm("post_feedforward_layernorm", plus_one=True),
        )

    def head(self, cfg: ModelConfig) -> Head:
        return Head(final_norm=RMSNorm("model.norm", plus_one=True), softcap=cfg.params["final_logit_softcapping"])

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        out = LLAMA.tensors(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        for n in range(cfg.num_layers):
            p = f"model.layers.{n}."
            out[p + "pre_feedforward_layernorm.weight"] = (h,)
            out[p + "post_feedforward_layernorm.weight"] = (h,)
            if self.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (d,)
                out[p + "self_attn.k_norm.weight"] = (d,)
            if cfg.attention_bias:
                out[p + "self_attn.o_proj.bias"] = (h,)
        return out

    # --- checkpoint names --------------------------------------------------------------

    def relayout_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> np.ndarray:
        # llama.cpp stored 1 + w; the plus_one RMSNorm adds the 1 back.
        return (w - np.float32(1.0)).astype(np.float32) if name.endswith("norm.weight") else w

    def from_hf(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, w in weights.items():
            canonical = _text_model_name(name)
            if canonical is not None:
                out[canonical] = w
        return out


def _text_model_name(name: str) -> str | None:
    """A checkpoint name as the text model's canonical one; None for the vision tower and projector.
    Multimodal gemma3 keeps the language model under ``language_model.model.`` (transformers 4)
    or ``model.language_model.`` (transformers 5)."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            name = "model." + name[len(prefix) :]
            break
    else:
        if name.startswith("language_model.lm_head."):
            name = name[len("language_model.") :]
    return name if name.startswith(("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")) else None


def _pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every ``pattern``-th layer full, the others sliding (HF's and llama.cpp's rule)."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _check_layer_types(layer_types: tuple[str, ...], num_layers: int, field_name: str) -> tuple[str, ...]:
    if len(layer_types) != num_layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ValueError(f"{field_name} {list(layer_types)} is not supported ({num_layers} of {SLIDING!r} / {FULL!r})")
    return layer_types


def _linear_scaling(arch: str, rope: dict, field_name: str) -> dict | None:
    """A rope parameters dict's scaling: None (default), linear, or refused naming the field."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "linear":
        raise ValueError(f"{arch}: {field_name} {kind!r} is not supported (only linear)")
    return {"rope_type": "linear", "factor": float(rope["factor"])}


def _opt_float(value) -> float | None:
    return None if value is None else float(value)


GEMMA2 = Gemma("gemma2", ("gemma2",), ("gemma2",))
GEMMA3 = Gemma("gemma3", ("gemma3_text", "gemma3"), ("gemma3",), qk_norm=True, pattern=6, layers_27b=62)
