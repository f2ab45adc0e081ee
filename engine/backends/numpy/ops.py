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


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[n, 1, rotary_dim]`` of each row's angles (float32, duplicated halves as HF's),
    times the rope's attention ``factor`` (yarn, longrope)."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos, sin


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` dims of ``x`` [n, heads, head_dim]
    (cos/sin [n, 1, rotary_dim]); the rest pass through (partial rotary)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return np.concatenate([rope_neox(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)
    half = rd // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def mrope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, section: tuple[int, ...], factor: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Multimodal rope's cos and sin ``[n, 1, rotary_dim]`` (``engine.models.ops.MRope``): rows at
    ``positions`` [3, n] (temporal, height, width), pair j of run k of ``section`` at position k % 3."""
    ang = positions.astype(np.float32)[:, :, None] * inv_freq[None, None, :]  # [3, n, pairs]
    which = np.repeat(np.arange(len(section)) % 3, section)  # the position each pair rotates by
    ang = ang[which, :, np.arange(len(which))].T  # [n, pairs]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos, sin


# Rotations by style; both styles pair dims as HF's rotate_half (mrope differs in its angles only).
ROPE: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {"neox": rope_neox, "mrope": rope_neox}


def softmax_inplace(s: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis in place; ``sink`` (broadcast to ``s[..., :1]``) joins
    the denominator as one more logit whose probability is dropped."""
    m = s.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    s -= m
    np.exp(s, out=s)
    denom = s.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom += np.exp(sink - m)
    s /= denom
    return s


def tanh_softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)`` (gemma2's attention and final logit soft-capping)."""
    return np.float32(cap) * np.tanh(x / np.float32(cap))


def attention_mask(q_pos: np.ndarray, ctx_pos: np.ndarray, window: int | None) -> np.ndarray | None:
    """Additive mask ``[n, T, S]`` for queries at ``q_pos`` [n, T] over keys at ``ctx_pos`` [n, S]:
    key j visible from query i iff ``j <= i`` and, with a ``window``, ``i - j < window``.
    None when every key is visible."""
    d = q_pos[:, :, None] - ctx_pos[:, None, :]
    allowed = d >= 0
    if window is not None:
        allowed &= d < window
    if allowed.all():
        return None
    return np.where(allowed, np.float32(0.0), np.float32(-np.inf))


def paged_attention(
    q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, ctx_slots: np.ndarray, mask: np.ndarray | None,
    num_kv_heads: int, *, scale: float | None = None, softcap: float | None = None, sinks: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """Batched causal GQA over the paged cache; returns ``[n * T, heads * head_dim]``.

    q [n * T, heads, hd]: rows grouped as n sequences of T query rows each
    (prefill: n=1, T=chunk; decode: n=lanes, T=1). ``k_rows`` / ``v_rows``
    [slots, kv_heads * hd]: one layer's cache. ``ctx_slots`` [n, S]: the slots
    each sequence attends to (padded); ``mask`` [n, T, S] additive, or None.
    Head h reads kv head ``h // (heads / kv_heads)`` (HF's ``repeat_kv``); the
    scores are scaled by ``scale`` (None: ``hd ** -0.5``), soft-capped when
    ``softcap``, masked, and softmaxed with head h's ``sinks[h]`` in the
    denominator when given (``engine.models.ops.Attention``).
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
    # the scale on q (1/sqrt(hd) is exact for hd a power of 4) rather than on the [.., S] scores.
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    qh = (q * np.float32(scale)).reshape(n, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)
    scores = qh.reshape(n, kvh, g * t, hd) @ k.transpose(0, 2, 3, 1)  # [n, kvh, g*T, S]
    if softcap is not None:
        scores = tanh_softcap(scores, softcap)
    scores = scores.reshape(n, kvh, g, t, s)
    if mask is not None:
        scores += mask[:, None, None, :, :]
    sink = None if sinks is None else sinks.astype(np.float32).reshape(1, kvh, g, 1, 1)
    p = softmax_inplace(scores, sink).reshape(n, kvh, g * t, s)
    o = p @ v.transpose(0, 2, 1, 3)  # [n, kvh, g*T, hd]
    return o.reshape(n, kvh, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(n * t, heads * hd)


def silu_gate(gate_up: np.ndarray, intermediate: int) -> np.ndarray:
    """``silu(gate) * up`` from the fused ``[n, gate | up]`` product (SwiGLU)."""
    g = gate_up[:, :intermediate]
    act = g / (1.0 + np.exp(-g))
    return act * gate_up[:, intermediate:]


def gelu_tanh_gate(gate_up: np.ndarray, intermediate: int) -> np.ndarray:
    """``gelu_tanh(gate) * up`` (GeGLU, HF's ``gelu_pytorch_tanh``) from the fused product."""
    g = gate_up[:, :intermediate]
    c = np.float32(math.sqrt(2.0 / math.pi))
    act = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))
    return act * gate_up[:, intermediate:]


ACTIVATIONS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {"silu": silu_gate, "gelu_tanh": gelu_tanh_gate}


def swiglu_oai(gate_up: np.ndarray, intermediate: int, limit: float | None) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: ``(clamp(up) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, limit)``."""
    g, u = gate_up[:, :intermediate], gate_up[:, intermediate:]
    if limit is not None:
        g = np.minimum(g, np.float32(limit))
        u = np.clip(u, np.float32(-limit), np.float32(limit))
    return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(np.float32(-1.702) * g)))


EXPERT_ACTIVATIONS: dict[str, Callable[[np.ndarray, int, float | None], np.ndarray]] = {
    "silu": lambda gu, i, _limit: silu_gate(gu, i),
    "swiglu_oai": swiglu_oai,
}


def route(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(expert ids [n, k], weights [n, k])``: softmax over all experts in float32, the k
    largest (ties: the lower id first), renormalised to sum 1 when ``normalize``."""
    p = softmax_inplace(np.array(logits, dtype=np.float32))
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def moe(x: np.ndarray, layer) -> np.ndarray:
    """A sparse MoE over rows ``x`` [n, hidden] (``engine.models.ops.MoE``; ``layer``:
    ``forward._Experts``): each expert runs once over the rows that chose it."""
    op = layer.op
    logits = layer.router(x)
    if layer.router_bias is not None:
        logits = logits + layer.router_bias
    ids, weights = route(logits, op.top_k, op.norm_topk_prob)
    out = np.zeros_like(x)
    act = EXPERT_ACTIVATIONS[op.act]
    for e in np.unique(ids):
        rows, k = np.nonzero(ids == e)
        gu = layer.gate_up[e](x[rows])
        if layer.gate_up_bias[e] is not None:
            gu += layer.gate_up_bias[e]
        y = layer.down[e](act(gu, gu.shape[1] // 2, op.swiglu_limit))
        if layer.down_bias[e] is not None:
            y += layer.down_bias[e]
        out[rows] += weights[rows, k][:, None] * y
    return out
