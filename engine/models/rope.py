"""Rotary frequencies as Hugging Face computes them (float32), with ``rope_scaling`` applied.

Shared by every backend: the numpy reference rotates with them, the CUDA
backend uploads them once at load.

longrope (Phi-3 / Phi-4's 128k models; ``su`` is its old name): each pair's
frequency is divided by a per-pair factor, ``long_factor`` or
``short_factor``, and cos and sin are scaled by an attention factor (given,
or ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))`` with ``s`` =
``factor`` or ``max_position / original_max_position_embeddings``, 1.0 when
``s <= 1``). transformers switches to the long factors once a sequence
outgrows ``original_max_position_embeddings``, recomputing every cached key;
a server whose KV cache outlives that switch cannot, so the set is chosen
once per load: long factors when the served context
(``ModelConfig.max_position``) exceeds the original window, short otherwise
(llama.cpp decides the same way, by its context size). A long-context model
served that way matches transformers on sequences past the original window
and differs (long factors where transformers uses short) on shorter ones.
"""

from __future__ import annotations

import math

import numpy as np

from engine.model_config import ModelConfig
from engine.models.ops import Rope


def rope_tables(cfg: ModelConfig, rope: Rope) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_factor)`` of one layer's rope.

    ``inv_freq``: float32 ``[rotary_dim / 2]`` as HF computes them, base
    ``rope.theta`` (or the model's), with ``cfg.rope_scaling`` applied when
    ``rope.scaled``. ``attention_factor`` multiplies cos and sin (1.0 but for
    yarn and longrope, as HF's ``attention_scaling``).
    """
    d = rope.rotary_dim or cfg.head_dim
    theta = cfg.rope_theta if rope.theta is None else rope.theta
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    if not rope.scaled:
        return inv, 1.0
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "longrope":
        return _longrope(cfg, theta, d)
    if kind == "yarn":
        return _yarn(rs, theta, d, cfg.max_position)
    return _scaled(cfg, inv), 1.0


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotary frequencies of the model's default rope (all of ``head_dim``, scaled)."""
    return rope_tables(cfg, Rope())[0]


def _scaled(cfg: ModelConfig, inv: np.ndarray) -> np.ndarray:
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return (inv / np.float32(rs["factor"])).astype(np.float32)
    if kind == "freq_factors":  # from a GGUF's rope_freqs tensor: llama.cpp divides each frequency
        return (inv / np.asarray(rs["factors"], dtype=np.float32)).astype(np.float32)
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")


def _longrope(cfg: ModelConfig, theta: float, d: int) -> tuple[np.ndarray, float]:
    rs = cfg.rope_scaling
    original = int(rs["original_max_position_embeddings"])
    which = "long_factor" if cfg.max_position > original else "short_factor"
    if which not in rs:
        raise ValueError(f"rope_scaling longrope: no {which} (served context {cfg.max_position}, original {original})")
    ext = np.asarray(rs[which], dtype=np.float32).reshape(-1)
    if len(ext) != d // 2:
        raise ValueError(f"rope_scaling longrope: {which} has {len(ext)} entries, the rope has {d // 2} pairs")
    # HF's order of operations, 1 / (factor * base ** (2i / d)), for bit-equal frequencies.
    powers = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))
    inv = (np.float32(1.0) / (ext * powers)).astype(np.float32)
    attention = rs.get("attention_factor")
    if attention is None:
        scale = rs.get("factor") or cfg.max_position / original
        attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    return inv, float(attention)


def _yarn(rs: dict, theta: float, d: int, max_position: int) -> tuple[np.ndarray, float]:
    """YaRN (HF's ``_compute_yarn_parameters``): each frequency blends its extrapolated value
    (unchanged) and its interpolated one (divided by ``factor``) by a ramp over the dims whose
    wavelengths fall between ``beta_fast`` and ``beta_slow`` rotations of the original context;
    cos and sin are scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the mscale
    ratio when ``mscale`` and ``mscale_all_dim`` are given). ``truncate`` (default True) rounds
    the ramp's ends outward to whole dims; gpt-oss sets it False."""
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits ``rotations`` times in ``orig``
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))
    extrapolated = (np.float32(1.0) / pos).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(factor) * pos)).astype(np.float32)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # the extrapolated share of each frequency
    inv = interpolated * (np.float32(1.0) - keep) + extrapolated * keep
    return inv.astype(np.float32), float(attention)
