"""Wrappers of engine/cu/vision.cu's kernels (the vision tower's own; engine/backends/cuda/vision.py)."""

from __future__ import annotations

import numpy as np

from engine.cu.launch import Kernel, module

VIS_QUERY_ROWS = 32  # vision.cu's VQT: query rows a vis_attn tile
TC_QUERY_ROWS = 64  # vision.cu's TQ: query rows a vis_attn_tc tile


class VisionKernels:
    """vision.cu compiled for one tower head size (a multiple of 16, at most 128). ``tensor_cores``:
    the attention runs vis_attn_tc (else the fp32 vis_attn); its tiles hold ``query_rows`` rows."""

    def __init__(self, head_dim: int, cache_dir: str = "", tensor_cores: bool = True) -> None:
        if head_dim % 16 or not 16 <= head_dim <= 128:
            raise ValueError(f"vision head_dim {head_dim} not supported (a multiple of 16 up to 128)")
        self.head_dim, self.tensor_cores = head_dim, tensor_cores
        mod = module("vision", (("VIS_HEAD_DIM", head_dim),), cache_dir)
        self._gather_bf16 = Kernel(mod, "vis_gather_bf16", "src:ptr idx:ptr out:ptr cols:i32", 256)
        self._gather_f32 = Kernel(mod, "vis_gather_f32", "src:ptr idx:ptr out:ptr cols:i32", 256)
        self._qkv_rope = Kernel(mod, "vis_qkv_rope", "qkv:ptr hw:ptr inv_freq:ptr q:ptr k:ptr v:ptr n:i32 H:i32",
                                head_dim // 2)  # fmt: skip
        attn = "q:ptr k:ptr v:ptr tiles:ptr out:ptr n:i32 H:i32 scale_log2:f32"
        self._attn = Kernel(mod, "vis_attn", attn, 128)
        self._attn_tc = Kernel(mod, "vis_attn_tc", attn, 128)
        self._gelu = Kernel(mod, "vis_gelu", "x:ptr out:ptr n:i64", 256)

    def gather(self, s, src: int, idx: int, out: int, rows: int, cols: int, to_bf16: bool) -> None:
        """out[i] = src[idx[i]] for ``rows`` rows of ``cols`` fp32 values (``to_bf16``: out is bf16)."""
        kern = self._gather_bf16 if to_bf16 else self._gather_f32
        kern(s, (rows,), src=src, idx=idx, out=out, cols=cols)

    def qkv_rope(self, s, qkv: int, hw: int, inv_freq: int, q: int, k: int, v: int, n: int, heads: int) -> None:
        self._qkv_rope(s, (n, heads), qkv=qkv, hw=hw, inv_freq=inv_freq, q=q, k=k, v=v, n=n, H=heads)

    @property
    def query_rows(self) -> int:
        return TC_QUERY_ROWS if self.tensor_cores else VIS_QUERY_ROWS

    def attention(self, s, q: int, k: int, v: int, tiles: int, num_tiles: int, out: int, n: int, heads: int) -> None:
        """Bidirectional attention over ``attention_tiles(bounds, self.query_rows)`` (vision.cu)."""
        scale_log2 = np.float32(self.head_dim**-0.5 * np.log2(np.e))
        kern = self._attn_tc if self.tensor_cores else self._attn
        kern(s, (num_tiles, heads), q=q, k=k, v=v, tiles=tiles, out=out, n=n, H=heads, scale_log2=scale_log2)

    def gelu(self, s, x: int, out: int, n: int) -> None:
        self._gelu(s, (max(1, min(4096, (n + 255) // 256)),), x=x, out=out, n=n)


def attention_tiles(bounds: list[int], rows: int = VIS_QUERY_ROWS) -> np.ndarray:
    """int32 [tiles, 4]: (q0, q1, k0, k1) for every ``rows``-row query tile of each segment
    ``[bounds[j], bounds[j + 1])``, attending over its segment (vis_attn's tiles)."""
    out = [
        (q, min(q + rows, hi), lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) for q in range(lo, hi, rows)
    ]  # fmt: skip
    return np.asarray(out, dtype=np.int32).reshape(-1, 4)
