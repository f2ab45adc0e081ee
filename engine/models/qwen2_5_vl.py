"""qwen2_5_vl: Qwen2.5-VL, a qwen2 language model behind a vision tower (``engine.models.vision``).

Config: transformers 5.24's layout (``text_config`` and ``vision_config`` beside the vision
token ids) or the Hub's older one (the text fields at the top level, ``vision_config`` beside
them). ``text_config.rope_parameters.mrope_section`` (or ``rope_scaling.mrope_section``) splits
the rotary pairs into temporal / height / width runs (``MRope``; it must sum to head_dim / 2);
the tower is ``ModelConfig.vision`` (``VisionConfig``). Videos are not served (only images);
sliding-window layers (``use_sliding_window``) are refused, as are other hidden_acts than silu.

Block: qwen2's (q/k/v biases, RMSNorm, SwiGLU) with ``MRope``; head as llama's.

Tensors: the language model's are llama's names (transformers 5 keeps the Hub's
``model.layers.*`` on save; ``model.language_model.*`` is read too), the tower's are
``visual.*`` (or ``model.visual.*``) with ``visual.patch_embed.proj.weight`` flattened from
the Conv3d's [hidden, channels, temporal, patch, patch] to [hidden, patch_dim]. No GGUF: the
llama.cpp conversion keeps the tower in a separate mmproj file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.model_config import ModelConfig, VisionConfig
from engine.models.base import ModelDefinition
from engine.models.llama import Llama
from engine.models.ops import Attention, Block, GatedMLP, MRope, RMSNorm
from engine.models.qwen3 import check_hidden_act

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def vision_from_hf(config: dict) -> VisionConfig:
    v = config["vision_config"]
    act = v.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"qwen2_5_vl: vision_config.hidden_act {act!r} is not supported (only silu)")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=int(v.get("depth", 32)),
        hidden_size=int(v.get("hidden_size", 3584)),
        intermediate_size=int(v.get("intermediate_size", 3420)),
        num_heads=int(v.get("num_heads", 16)),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", 3)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(config.get("image_token_id", 151655)),
        video_token_id=int(config.get("video_token_id", 151656)),
        vision_start_token_id=int(config.get("vision_start_token_id", 151652)),
    )


@dataclass(frozen=True)
class Qwen2_5_VL(Llama):
    qkv_bias_default: bool = True
    gguf_permuted_qk: bool = False

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        sub = config.get("text_config") or {}
        text = {**config, **sub}
        # transformers ties when either level says so (pre-5 saves kept the flag in text_config).
        text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings") or sub.get("tie_word_embeddings"))
        check_hidden_act(self.name, text)
        if text.get("use_sliding_window"):
            raise ValueError("qwen2_5_vl: use_sliding_window is not supported")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = tuple(int(s) for s in rope.get("mrope_section", ()))
        # mrope_section is no scaling: the rope is default (transformers' "mrope" type says so too).
        plain = {k: v for k, v in rope.items() if k not in ("mrope_section", "type", "rope_type")}
        text = {**text, "rope_parameters": {**plain, "rope_type": "default"}, "rope_scaling": None}
        cfg = super().config_from_hf(text, generation)
        if len(section) != 3 or sum(section) != cfg.head_dim // 2:
            raise ValueError(f"qwen2_5_vl: mrope_section {list(section)} must be 3 runs summing to head_dim / 2")
        vision = vision_from_hf(config)
        if vision.out_hidden_size != cfg.hidden_size:
            raise ValueError(
                f"qwen2_5_vl: vision out_hidden_size {vision.out_hidden_size} != hidden_size {cfg.hidden_size}"
            )
        return dataclasses.replace(cfg, vision=vision, params={**cfg.params, "mrope_section": section})

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        raise ValueError("qwen2_5_vl: GGUF files are not supported (serve the Hugging Face directory)")

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        return Block(
            attn_norm=RMSNorm("input_layernorm"),
            attention=Attention(rope=MRope(section=cfg.params["mrope_section"]), qkv_bias=True),
            mlp_norm=RMSNorm("post_attention_layernorm"),
            mlp=GatedMLP("silu"),
        )

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        out = super().tensors(cfg)
        out.update(vision_tensors(cfg.vision))
        return out

    def from_hf(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        renamed = {}
        for name, w in weights.items():
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
            if name == "visual.patch_embed.proj.weight":
                w = w.reshape(w.shape[0], -1)
            renamed[name] = w
        return ModelDefinition.from_hf(self, cfg, renamed)


def vision_tensors(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The tower's tensors (``visual.*``), float32 ``[out, in]``."""
    d, i, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    out: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": (d, v.patch_dim)}
    for n in range(v.depth):
        p = f"visual.blocks.{n}."
        out.update({
            p + "norm1.weight": (d,), p + "norm2.weight": (d,),
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
            p + "mlp.gate_proj.weight": (i, d), p + "mlp.gate_proj.bias": (i,),
            p + "mlp.up_proj.weight": (i, d), p + "mlp.up_proj.bias": (i,),
            p + "mlp.down_proj.weight": (d, i), p + "mlp.down_proj.bias": (d,),
        })  # fmt: skip
    out.update({
        "visual.merger.ln_q.weight": (d,),
        "visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (v.out_hidden_size, merged), "visual.merger.mlp.2.bias": (v.out_hidden_size,),
    })  # fmt: skip
    return out


QWEN2_5_VL = Qwen2_5_VL("qwen2_5_vl", ("qwen2_5_vl",), ())
