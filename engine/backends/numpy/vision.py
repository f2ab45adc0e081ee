"""The numpy reference of the Qwen2.5-VL vision tower (``engine.models.vision`` describes it).

One image at a time: its patches in, one ``out_hidden_size`` row per placeholder token out.
Numerics follow transformers' modeling code (float32; RMSNorm eps 1e-6; the 2D rotary angles
in float32; exact GELU in the merger). Attention runs segment by segment (a window, or a frame
in the full-attention blocks), a few hundred query rows at a time, so a 1,024 x 1,024 image's
full-attention blocks never hold a whole [heads, rows, rows] score matrix.
"""

from __future__ import annotations

import math

import numpy as np

from engine.model_config import VisionConfig
from engine.models.vision import frame_bounds, rotary_positions, window_index

from . import ops
from .linear import Linear

_QUERY_ROWS = 512  # query rows per attention product


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """Exact GELU, ``x * (1 + erf(x / sqrt 2)) / 2`` (torch's ``nn.GELU()``); numpy has no erf:
    Abramowitz-Stegun 7.1.26 in float64 (absolute error below 1.5e-7)."""
    z = x.astype(np.float64) / math.sqrt(2.0)
    a = np.abs(z)
    k = 1.0 / (1.0 + 0.3275911 * a)
    poly = k * (0.254829592 + k * (-0.284496736 + k * (1.421413741 + k * (-1.453152027 + k * 1.061405429))))
    erf = np.sign(z) * (1.0 - poly * np.exp(-a * a))
    return (0.5 * x * (1.0 + erf)).astype(np.float32)


class _Block:
    def __init__(self, w, p: str):
        self.norm1, self.norm2 = w(p + "norm1.weight"), w(p + "norm2.weight")
        self.qkv, self.qkv_b = Linear(w(p + "attn.qkv.weight")), w(p + "attn.qkv.bias")
        self.proj, self.proj_b = Linear(w(p + "attn.proj.weight")), w(p + "attn.proj.bias")
        gate_up = np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
        self.gate_up = Linear(gate_up)
        self.gate_up_b = np.concatenate([w(p + "mlp.gate_proj.bias"), w(p + "mlp.up_proj.bias")])
        self.down, self.down_b = Linear(w(p + "mlp.down_proj.weight")), w(p + "mlp.down_proj.bias")


class VisionTower:
    """The tower's weights (``visual.*``) and ``encode``, one image's patches to its token rows."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, np.ndarray]):
        def w(name: str) -> np.ndarray:
            return np.asarray(weights[name], dtype=np.float32)

        self.cfg = cfg
        self.patch_embed = Linear(w("visual.patch_embed.proj.weight"))
        self.blocks = [_Block(w, f"visual.blocks.{n}.") for n in range(cfg.depth)]
        self.ln_q = w("visual.merger.ln_q.weight")
        self.mlp0, self.mlp0_b = Linear(w("visual.merger.mlp.0.weight")), w("visual.merger.mlp.0.bias")
        self.mlp2, self.mlp2_b = Linear(w("visual.merger.mlp.2.weight")), w("visual.merger.mlp.2.bias")
        hd = cfg.head_dim
        half = hd // 2  # h rotates the first half of the pairs' angles, w the second
        self.inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, half, 2, dtype=np.float32) / half))).astype(
            np.float32
        )

    @property
    def nbytes(self) -> int:
        n = self.patch_embed.nbytes + self.ln_q.nbytes + self.mlp0.nbytes + self.mlp2.nbytes
        n += self.mlp0_b.nbytes + self.mlp2_b.nbytes
        for b in self.blocks:
            n += sum(a.nbytes for a in vars(b).values())
        return n

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        """float32 [t*h*w / merge**2, out_hidden_size]: the image's placeholder rows, in prompt order."""
        cfg = self.cfg
        unit = cfg.spatial_merge_size**2
        n = pixel_values.shape[0]
        x = self.patch_embed(np.ascontiguousarray(pixel_values, dtype=np.float32))
        index, windows = window_index(grid_thw, cfg)
        order = (index[:, None] * unit + np.arange(unit)).reshape(-1)  # rows in window order
        x = x[order]
        ang = rotary_positions(grid_thw, cfg.spatial_merge_size)[order].astype(np.float32)
        ang = np.concatenate([ang[:, :1] * self.inv_freq, ang[:, 1:] * self.inv_freq], axis=-1)
        ang = np.concatenate([ang, ang], axis=-1)[:, None, :]  # [n, 1, head_dim]
        cos, sin = np.cos(ang), np.sin(ang)
        frames = frame_bounds(grid_thw)
        eps = cfg.rms_norm_eps
        with np.errstate(over="ignore"):
            for i, b in enumerate(self.blocks):
                bounds = frames if i in cfg.fullatt_block_indexes else windows
                h = ops.rms_norm(x, b.norm1, eps)
                qkv = (b.qkv(h) + b.qkv_b).reshape(n, 3, cfg.num_heads, cfg.head_dim)
                q = ops.rope_neox(qkv[:, 0], cos, sin)
                k = ops.rope_neox(qkv[:, 1], cos, sin)
                x = x + (b.proj(_segment_attention(q, k, qkv[:, 2], bounds)) + b.proj_b)
                h = ops.rms_norm(x, b.norm2, eps)
                gu = b.gate_up(h) + b.gate_up_b
                x = x + (b.down(ops.silu_gate(gu, cfg.intermediate_size)) + b.down_b)
        merged = ops.rms_norm(x, self.ln_q, eps).reshape(n // unit, -1)
        out = self.mlp2(gelu_erf(self.mlp0(merged) + self.mlp0_b)) + self.mlp2_b
        return out[np.argsort(index)]


def _segment_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Bidirectional attention within each ``[bounds[j], bounds[j+1])`` row segment; q/k/v
    [n, heads, hd] -> [n, heads * hd]."""
    n, heads, hd = q.shape
    out = np.empty((n, heads, hd), dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(hd))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        kt = k[lo:hi].transpose(1, 2, 0)  # [heads, hd, S]
        vs = v[lo:hi].transpose(1, 0, 2)  # [heads, S, hd]
        for r in range(lo, hi, _QUERY_ROWS):
            e = min(r + _QUERY_ROWS, hi)
            s = (q[r:e].transpose(1, 0, 2) * scale) @ kt  # [heads, rows, S]
            out[r:e] = (ops.softmax_inplace(s) @ vs).transpose(1, 0, 2)
    return out.reshape(n, heads * hd)
