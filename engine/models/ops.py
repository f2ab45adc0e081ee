"""The operations a model definition composes a decoder block from.

A definition (``engine/models/<family>.py``) says *what* a block computes as a
``Block`` of these frozen dataclasses; each backend says *how*: the numpy
backend holds the reference implementation of every operation
(``engine/backends/numpy/ops.py``), the CUDA backend maps each operation, or a
fused group of them, to kernels and refuses at load any operation it has no
kernel for. A new architecture that only recombines these needs no backend
change; one with a new operation adds it here, its numpy reference, and its
CUDA kernels.

Tensor names inside a block are the canonical (Hugging Face llama) suffixes
under ``model.layers.{i}.``: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RMSNorm:
    """``w * x / sqrt(mean(x^2) + eps)`` in float32 (eps: ``ModelConfig.rms_norm_eps``)."""

    weight: str  # canonical tensor name without ``.weight``, e.g. "input_layernorm"
    plus_one: bool = False  # gemma: scale by (1 + w)


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding over q and k.

    ``style`` "neox": HF's ``rotate_half`` pairing (dim i with i + head_dim/2),
    frequencies from ``ModelConfig.rope_theta`` and ``rope_scaling``.
    """

    style: str = "neox"


@dataclass(frozen=True)
class Attention:
    """Grouped-query causal self-attention over the paged KV cache.

    q|k|v projections (with biases when ``qkv_bias``), rope on q and k, softmax
    scaled by ``head_dim ** -0.5``, output projection ``o_proj``.
    """

    rope: Rope | None = field(default_factory=Rope)
    qkv_bias: bool = False


@dataclass(frozen=True)
class GatedMLP:
    """``down(act(gate(x)) * up(x))``; ``act`` "silu" (SwiGLU)."""

    act: str = "silu"


@dataclass(frozen=True)
class Block:
    """One decoder layer. ``residual`` "pre_norm":
    ``x += attention(attn_norm(x)); x += mlp(mlp_norm(x))``."""

    attn_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm
    mlp: GatedMLP
    residual: str = "pre_norm"


@dataclass(frozen=True)
class Head:
    """After the last block: ``final_norm``, then the LM head (``lm_head`` or the tied embedding)."""

    final_norm: RMSNorm = field(default_factory=lambda: RMSNorm("model.norm"))
