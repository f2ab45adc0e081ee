"""qwen3 and qwen3_moe: llama's block with a per-head RMSNorm on q and k before rope.

Config: HF ``Qwen3Config`` / ``Qwen3MoeConfig``. ``head_dim`` is its own field
(absent: 128 for qwen3, as transformers' default, ``hidden / heads`` for
qwen3_moe); ``attention_bias`` puts biases on q, k, v *and* o. Sliding-window
attention only when ``use_sliding_window``: qwen3 then slides the layers
``layer_types`` names (absent: those from ``max_window_layers`` on), qwen3_moe
slides every layer. ``rope_scaling`` as llama's (Qwen3's long-context recipe is
yarn, ``engine.models.rope``); a GGUF's yarn is ``rope.scaling.type`` /
``factor`` / ``original_context_length``, any type but none, linear and yarn is
refused. ``hidden_act`` other than silu is refused.

qwen3_moe's layer i is sparse (``MoE``: ``num_experts`` of width
``moe_intermediate_size``, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``) unless i is in ``mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step != 0``, where it is the dense ``GatedMLP`` of width
``intermediate_size``. The dense layers are kept as ``params["mlp_only_layers"]``.
transformers 5.24 names the expert count ``num_local_experts`` when it saves a
config, Hub configs ``num_experts``; both are read. Shared experts (qwen2_moe's)
are refused.

Tensors: HF names are canonical (experts per expert, as Hub checkpoints and
transformers 5's ``save_pretrained`` store them; its stacked in-memory layout
is split too, ``engine.models.experts``). llama.cpp: llama's names plus
``attn_q_norm`` / ``attn_k_norm``, router ``ffn_gate_inp``, experts
``ffn_{gate,up,down}_exps``; its converter leaves qwen3's q/k rows in HF order
(qwen3 converts as qwen2 does). GGUF metadata: ``qwen3moe.expert_count``,
``expert_used_count``, ``expert_feed_forward_length``; a layer with a dense
``ffn_gate`` is dense. llama.cpp's qwen3moe graph always renormalises the top
k, so ``expert_weights_norm`` absent means True.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.model_config import ModelConfig
from engine.models import experts
from engine.models.base import TensorMap
from engine.models.llama import LLAMA_GGUF, Llama
from engine.models.ops import Attention, Block, GatedMLP, MoE, QKNorm, RMSNorm

QWEN3_GGUF = TensorMap(
    layer={
        **LLAMA_GGUF.layer,
        "attn_q_norm.weight": ("self_attn.q_norm.weight",),
        "attn_k_norm.weight": ("self_attn.k_norm.weight",),
        "attn_output.bias": ("self_attn.o_proj.bias",),
    },
    globals=LLAMA_GGUF.globals,
    layer_prefix=LLAMA_GGUF.layer_prefix,
)
QWEN3_MOE_GGUF = dataclasses.replace(QWEN3_GGUF, layer={**QWEN3_GGUF.layer, experts.GGUF_ROUTER: ("mlp.gate.weight",)})

_LAYER_TYPES = ("full_attention", "sliding_attention")
_GGUF_ROPE_SCALINGS = (None, "none", "linear")  # llama's GGUF parsing reads these; yarn is read here


def gguf_yarn(meta: dict, arch: str) -> dict:
    """A GGUF's yarn keys as HF's ``rope_scaling`` (llama.cpp's defaults where a key is absent are HF's:
    beta_fast 32, beta_slow 1, attention factor ``0.1 ln(factor) + 1``, dims rounded outwards)."""
    key = f"{arch}.rope.scaling."
    scaling = {"rope_type": "yarn", "factor": float(meta[key + "factor"]),
               "original_max_position_embeddings": int(meta[key + "original_context_length"])}  # fmt: skip
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if meta.get(key + gguf_key) is not None:
            scaling[hf_key] = float(meta[key + gguf_key])
    return scaling


def check_hidden_act(arch: str, config: dict) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act {config['hidden_act']!r} is not supported (only silu)")


@dataclass(frozen=True)
class Qwen3(Llama):
    gguf_map: TensorMap = field(default=QWEN3_GGUF, repr=False)
    gguf_permuted_qk: bool = False
    head_dim_default: int | None = None  # what a config.json without head_dim means (None: hidden / heads)

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        check_hidden_act(self.name, config)
        if self.head_dim_default is not None:
            config = {"head_dim": self.head_dim_default, **config}
        cfg = super().config_from_hf(config, generation)
        window, layer_types = self.window_from_hf(config, cfg.num_layers)
        return dataclasses.replace(cfg, sliding_window=window, layer_types=layer_types)

    def window_from_hf(self, config: dict, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
        """``(sliding_window, layer_types)`` as transformers' Qwen3Config resolves them."""
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        if not window:
            return None, ()
        types = config.get("layer_types")
        if types is None:
            first = int(config.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if len(types) != num_layers or not set(types) <= set(_LAYER_TYPES):
            raise ValueError(f"{self.name}: layer_types {types!r} is not one of {_LAYER_TYPES} per layer")
        if "sliding_attention" not in types:
            return None, ()
        return int(window), tuple(types)

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        cfg = super().config_from_gguf(meta, tensor_names)
        arch = meta["general.architecture"]
        kind = meta.get(f"{arch}.rope.scaling.type")
        if kind == "yarn":
            return dataclasses.replace(cfg, rope_scaling=gguf_yarn(meta, arch))
        if kind not in _GGUF_ROPE_SCALINGS:
            raise ValueError(f"{self.name}: {arch}.rope.scaling.type {kind!r} is not supported (yarn, linear)")
        return cfg

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        bias = cfg.attention_bias
        return Block(
            attn_norm=RMSNorm("input_layernorm"),
            attention=Attention(qkv_bias=bias, o_bias=bias, qk_norm=QKNorm(), sliding_window=cfg.layer_window(layer)),
            mlp_norm=RMSNorm("post_attention_layernorm"),
            mlp=GatedMLP("silu"),
        )

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        out = super().tensors(cfg)
        for n in range(cfg.num_layers):
            p = f"model.layers.{n}.self_attn."
            out[p + "q_norm.weight"] = out[p + "k_norm.weight"] = (cfg.head_dim,)
            if cfg.attention_bias:
                out[p + "o_proj.bias"] = (cfg.hidden_size,)
        return out


@dataclass(frozen=True)
class Qwen3Moe(Qwen3):
    gguf_map: TensorMap = field(default=QWEN3_MOE_GGUF, repr=False)

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        if config.get("shared_expert_intermediate_size"):
            raise ValueError(f"{self.name}: shared_expert_intermediate_size (shared experts) is not supported")
        cfg = super().config_from_hf(config, generation)
        # transformers' Qwen3MoeConfig defaults where a field is absent.
        num_experts = config.get("num_experts")
        num_experts = int(config.get("num_local_experts", 128) if num_experts is None else num_experts)
        step = int(config.get("decoder_sparse_step", 1))
        mlp_only = {int(i) for i in config.get("mlp_only_layers") or ()}
        dense = tuple(i for i in range(cfg.num_layers) if i in mlp_only or num_experts == 0 or (i + 1) % step)
        return self._with_experts(
            cfg, num_experts, int(config.get("num_experts_per_tok", 8)), int(config.get("moe_intermediate_size", 768)),
            dense, bool(config.get("norm_topk_prob", False)),
        )  # fmt: skip

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        arch = meta["general.architecture"]

        def key(name, default=None):
            return meta.get(f"{arch}.{name}", default)

        for shared in ("expert_shared_count", "expert_shared_feed_forward_length"):
            if key(shared):
                raise ValueError(f"{self.name}: {arch}.{shared} (shared experts) is not supported")
        if key("expert_gating_func") not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ValueError(f"{self.name}: {arch}.expert_gating_func {key('expert_gating_func')} (only softmax)")
        cfg = super().config_from_gguf(meta, tensor_names)
        dense = tuple(n for n in range(cfg.num_layers) if f"blk.{n}.ffn_gate.weight" in tensor_names)
        return self._with_experts(
            cfg, int(key("expert_count", 0)), int(key("expert_used_count", 0)),
            int(key("expert_feed_forward_length", 0)), dense, bool(key("expert_weights_norm", True)),
        )  # fmt: skip

    def _with_experts(
        self, cfg: ModelConfig, num_experts: int, top_k: int, width: int, dense: tuple[int, ...], norm_topk_prob: bool
    ) -> ModelConfig:
        if len(dense) < cfg.num_layers:
            experts.check_routing(self.name, num_experts, top_k)
        params = {**cfg.params, "mlp_only_layers": dense, "norm_topk_prob": norm_topk_prob}
        return dataclasses.replace(
            cfg, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width, params=params
        )

    def window_from_hf(self, config: dict, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        return (int(window) if window else None), ()  # every layer slides (one mask for all in transformers)

    @staticmethod
    def is_sparse(cfg: ModelConfig, layer: int) -> bool:
        return layer not in cfg.params.get("mlp_only_layers", ())

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        block = super().block(cfg, layer)
        if not self.is_sparse(cfg, layer):
            return block
        moe = MoE(cfg.num_experts, cfg.num_experts_per_tok, norm_topk_prob=cfg.params.get("norm_topk_prob", True))
        return dataclasses.replace(block, mlp=moe)

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        out = super().tensors(cfg)
        for n in range(cfg.num_layers):
            if self.is_sparse(cfg, n):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    del out[f"model.layers.{n}.mlp.{proj}.weight"]
                out.update(experts.sparse_layer_tensors(cfg, n))
        return out

    def from_hf(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, w in weights.items():
            parts = experts.split_hf_stacked(cfg, name, w)
            out.update(super().from_hf(cfg, {name: w}) if parts is None else parts)
        return out

    def from_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        parts = experts.split_gguf_experts(cfg, name, w)
        if parts is None:
            return super().from_gguf(cfg, name, w)
        return iter(parts)

    def is_known_gguf(self, name: str) -> bool:
        return experts.is_gguf_experts(name) or super().is_known_gguf(name)


QWEN3 = Qwen3("qwen3", ("qwen3",), ("qwen3",), head_dim_default=128)
QWEN3_MOE = Qwen3Moe("qwen3_moe", ("qwen3_moe",), ("qwen3moe",))
