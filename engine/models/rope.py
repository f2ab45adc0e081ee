"""Rotary frequencies as Hugging Face computes them (float32), with ``rope_scaling`` applied.

Shared by every backend: the numpy reference rotates with them, the CUDA
backend uploads them once at load.
"""

from __future__ import annotations

import math

import numpy as np

from engine.model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotary frequencies (float32, as HF computes them), with rope_scaling applied."""
    d = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(
        np.float32
    )
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
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported by the numpy backend")
