"""The reference implementation of every operation in ``engine.models.ops`` (float32 numpy).

Numerics follow Hugging Face's modeling code, which the parity tests compare
against: RMSNorm in float32, ``rotate_half`` RoPE with float32 angles, GQA by
``repeat_kv``, SwiGLU. Every other backend is checked against these.

Shapes: activations are rows ``[n, hidden]``; q/k ``[n, heads, head_dim]``.
The KV cache is read through ``[slots, kv_heads * head_dim]`` row views
(``forward.KVViews``), one row per token slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from engine.models.ops import RMSNorm


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``w * x / sqrt(mean(x^2) + eps)``; ``w`` already carries RMSNorm.plus_one (see ``norm_weight``)."""
    # np.mean's own arithmetic (a float32 sum, then / count) without its Python wrapper.
    var = np.add.reduce(x * x, axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return w * (x / np.sqrt(var + np.float32(eps)))


def norm_weight(op: RMSNorm, w: np.ndarray) -> np.ndarray:
    """The scale RMSNorm applies: ``w``, or ``1 + w`` (gemma's plus_one), folded once at load."""
    return (np.float32(1.0) + w).astype(np.float32) if op.plus_one else w


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[n, 1, head_dim]`` of each row's angles (float32, duplicated halves as HF's)."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    return np.cos(ang), np.sin(ang)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` on ``x`` [n, heads, head_dim]; cos/sin [n, 1, head_dim]."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


ROPE: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {"neox": rope_neox}


def softmax_inplace(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def paged_attention(
    q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, ctx_slots: np.ndarray, mask: np.ndarray | None,
    num_kv_heads: int,
) -> np.ndarray:  # fmt: skip
    """Batched causal GQA over the paged cache; returns ``[n * T, heads * head_dim]``.

    q [n * T, heads, hd]: rows grouped as n sequences of T query rows each
    (prefill: n=1, T=chunk; decode: n=lanes, T=1). ``k_rows`` / ``v_rows``
    [slots, kv_heads * hd]: one layer's cache. ``ctx_slots`` [n, S]: the slots
    each sequence attends to (padded); ``mask`` [n, T, S] additive, or None.
    Head h reads kv head ``h // (heads / kv_heads)`` (HF's ``repeat_kv``); the
    softmax is scaled by ``hd ** -0.5``.
    """
    n, s = ctx_slots.shape
    t = q.shape[0] // n
    heads, hd = q.shape[1], q.shape[2]
    kvh, g = num_kv_heads, heads // num_kv_heads
    # One [kv_heads * head_dim] row per slot: np.take of whole rows copies faster than 4-D fancy indexing.
    flat = ctx_slots.reshape(-1)
    k = np.take(k_rows, flat, axis=0).reshape(n, s, kvh, hd)
    v = np.take(v_rows, flat, axis=0).reshape(n, s, kvh, hd)
    # Query rows per kv head: [n, kvh, g*T, hd], head h reading kv head h // g (HF's repeat_kv);
    # the 1/sqrt(hd) scale on q (exact for hd a power of 4) rather than on the [.., S] scores.
    qh = (q * np.float32(1.0 / math.sqrt(hd))).reshape(n, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)
    scores = qh.reshape(n, kvh, g * t, hd) @ k.transpose(0, 2, 3, 1)  # [n, kvh, g*T, S]
    if mask is not None:
        scores = scores.reshape(n, kvh, g, t, s)
        scores += mask[:, None, None, :, :]
    p = softmax_inplace(scores).reshape(n, kvh, g * t, s)
    o = p @ v.transpose(0, 2, 1, 3)  # [n, kvh, g*T, hd]
    return o.reshape(n, kvh, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(n * t, heads * hd)


def silu_gate(gate_up: np.ndarray, intermediate: int) -> np.ndarray:
    """``silu(gate) * up`` from the fused ``[n, gate | up]`` product (SwiGLU)."""
    g = gate_up[:, :intermediate]
    act = g / (1.0 + np.exp(-g))
    return act * gate_up[:, intermediate:]


ACTIVATIONS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {"silu": silu_gate}
