"""The operations a model definition composes a decoder block from.

A definition (``engine/models/<family>.py``) says *what* a block computes as a
``Block`` of these frozen dataclasses; each backend says *how*: the numpy
backend holds the reference implementation of every operation
(``engine/backends/numpy/ops.py``), the CUDA backend maps each operation, or a
fused group of them, to kernels and refuses at load any operation it has no
kernel for. A new architecture that only recombines these needs no backend
change; one with a new operation adds it here, its numpy reference, and its
CUDA kernels.

Blocks may differ by layer (``ModelDefinition.block(cfg, layer)``): gemma3 and
gpt-oss interleave sliding-window and full attention with their own rope,
qwen3_moe mixes dense and sparse MLPs.

Tensor names inside a block are the canonical (Hugging Face) suffixes under
``model.layers.{i}.``: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``; for the ops below
also ``self_attn.{q,k}_norm``, ``self_attn.sinks``, ``mlp.gate`` (the router)
and ``mlp.experts.{e}.{gate,up,down}_proj``. Every weight is float32
``[out, in]`` as ``torch.nn.Linear`` stores it.
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

    ``style`` "neox": HF's ``rotate_half`` pairing (dim i with i + rotary_dim/2)
    over the first ``rotary_dim`` dims of each head (None: all of them; the rest
    pass through, Phi-4-mini's ``partial_rotary_factor``).

    Frequencies: ``engine.models.rope.rope_tables(cfg, rope)``: base ``theta``
    (None: ``ModelConfig.rope_theta``), then ``ModelConfig.rope_scaling`` unless
    ``scaled`` is False (gemma3's local layers use their own base, unscaled).
    Some scalings (yarn, longrope) also scale cos and sin by an attention
    factor, which ``rope_tables`` returns beside the frequencies.
    """

    style: str = "neox"
    theta: float | None = None
    scaled: bool = True
    rotary_dim: int | None = None


@dataclass(frozen=True)
class MRope(Rope):
    """Multimodal rope (Qwen2-VL, Qwen2.5-VL): every row carries three positions (temporal,
    height, width) and the rotary pairs are split in ``section`` runs (summing to
    ``rotary_dim / 2``), run k rotating by position ``k % 3``. A text row's three positions are
    equal, so it rotates as ``Rope``; an image's placeholder rows take their patch's (t, h, w).
    The step interface carries the three positions of a prefill span's rows
    (``PrefillSpan.rope_positions``) and, for decode rows, the offset from the KV position
    (``DecodeLane.rope_delta``)."""

    style: str = "mrope"
    section: tuple[int, ...] = ()


@dataclass(frozen=True)
class QKNorm:
    """RMSNorm over each head's ``head_dim`` values of q and of k, after the
    projections (and biases) and before rope (qwen3, gemma3); eps as RMSNorm's."""

    q_weight: str = "self_attn.q_norm"  # [head_dim]
    k_weight: str = "self_attn.k_norm"  # [head_dim]
    plus_one: bool = False  # gemma3: scale by (1 + w)


@dataclass(frozen=True)
class Attention:
    """Grouped-query causal self-attention over the paged KV cache.

    q|k|v projections (with biases when ``qkv_bias``), ``qk_norm`` if set, rope
    on q and k, scores ``q . k * scale`` (``scale`` None: ``head_dim ** -0.5``;
    gemma: ``query_pre_attn_scalar ** -0.5``), then if ``softcap``:
    ``softcap * tanh(scores / softcap)`` (gemma2), then the causal mask and,
    with ``sliding_window`` W, the window: a query at position i sees the key
    at j iff ``0 <= i - j < W`` (Hugging Face's rule). With ``sinks`` the
    per-head logit ``self_attn.sinks`` [heads] joins each row's softmax
    denominator (its probability is dropped, gpt-oss). Head h reads kv head
    ``h // (heads / kv_heads)``. Output projection ``o_proj`` (plus its bias
    when ``o_bias``, gpt-oss).
    """

    rope: Rope | None = field(default_factory=Rope)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNorm | None = None
    scale: float | None = None
    softcap: float | None = None
    sliding_window: int | None = None
    sinks: bool = False


@dataclass(frozen=True)
class GatedMLP:
    """``down(act(gate(x)) * up(x))``; ``act`` "silu" (SwiGLU) or "gelu_tanh"
    (GeGLU with the tanh approximation, HF's ``gelu_pytorch_tanh``)."""

    act: str = "silu"


@dataclass(frozen=True)
class MoE:
    """A sparse mixture of experts, per row (token) independently.

    Router: ``logits = mlp.gate(x)`` (+ ``mlp.gate.bias`` when ``router_bias``),
    ``p = softmax(logits)`` in float32 over all ``num_experts``, the ``top_k``
    largest (ties: the lower expert id), renormalised to sum 1 when
    ``norm_topk_prob`` (qwen3_moe's flag; mixtral and gpt-oss always do, which
    is the same as a softmax over the top-k logits).

    Expert e (intermediate ``ModelConfig.moe_intermediate_size``):
    ``mlp.experts.{e}.down_proj(act(gate_proj(x), up_proj(x)))``, each
    projection plus its ``.bias`` when ``expert_bias``; ``act`` "silu" is
    SwiGLU, "swiglu_oai" is gpt-oss's clamped one:
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(1.702 * g)`` with ``limit`` = ``swiglu_limit``.
    The row's output is the sum of its k experts' outputs times their weights.
    """

    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    act: str = "silu"
    swiglu_limit: float | None = None


@dataclass(frozen=True)
class Block:
    """One decoder layer. ``residual`` "pre_norm":
    ``x += attn_post_norm(attention(attn_norm(x)))`` then
    ``x += mlp_post_norm(mlp(mlp_norm(x)))``, each post-norm only where set
    (gemma2/3 set both: "sandwich" norms)."""

    attn_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm
    mlp: GatedMLP | MoE
    attn_post_norm: RMSNorm | None = None
    mlp_post_norm: RMSNorm | None = None
    residual: str = "pre_norm"


@dataclass(frozen=True)
class Embedding:
    """``model.embed_tokens`` rows, times ``scale`` (gemma: ``sqrt(hidden)``)."""

    scale: float = 1.0


@dataclass(frozen=True)
class Head:
    """After the last block: ``final_norm``, then the LM head (``lm_head`` or the
    tied embedding), then if ``softcap``: ``softcap * tanh(logits / softcap)`` (gemma2)."""

    final_norm: RMSNorm = field(default_factory=lambda: RMSNorm("model.norm"))
    softcap: float | None = None
