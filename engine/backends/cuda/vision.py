"""The Qwen2.5-VL vision tower on the device (``engine.models.vision`` describes the computation,
engine/backends/numpy/vision.py is its reference).

One image at a time, on the backend's stream:

| step | kernels |
|---|---|
| patches to window order, bf16 | vis_gather_bf16 (the order and each row's (h, w) computed on the host) |
| patch embedding (no bias) | GEMM (``Kernels.linear``) |
| norm1, q\\|k\\|v (+ bias) | rmsnorm, GEMM |
| 2D rotary, q / k / v to head-major bf16 | vis_qkv_rope |
| attention within windows (frames in the full-attention blocks) | vis_attn_tc over (q0, q1, k0, k1) tiles |
| proj (+ bias), residual add | GEMM (accumulate) |
| norm2, gate\\|up (+ bias), SwiGLU, down (+ bias), residual add | rmsnorm, GEMM, swiglu, GEMM (accumulate) |
| merger: ln_q, 4 rows as one, mlp.0, exact GELU, mlp.2 | rmsnorm, GEMM, vis_gelu, GEMM |
| rows back to prompt order | vis_gather_f32, then one copy to the host |

Weights are bf16 (biases fp32) as the language model's; an MLP width that is not a multiple of 8
(Qwen2.5-VL's 3420) is padded with zero rows of gate and up and zero columns of down (the GEMM
reads K in multiples of 8; silu(0) * 0 adds nothing). The activations are allocated at load for
``max_patches`` patches (an image with more fails its request). The encoded rows go to the
host (``Image.embeds``, float32 [tokens, out_hidden], as the numpy backend keeps them): the
prefill chunks that reach the placeholders copy them over the token embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.model_config import VisionConfig
from engine.models.vision import frame_bounds, rotary_positions, window_index

MAX_PATCHES = 16384  # the processor's default max_pixels (12,845,056) in 14 x 14 patches


@dataclass
class _Block:
    norm1: int
    norm2: int
    qkv: int
    qkv_b: int
    proj: int
    proj_b: int
    gate_up: int  # bf16 [2 * padded I, hidden]: gate rows then up rows
    gate_up_b: int
    down: int  # bf16 [hidden, padded I]
    down_b: int


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _pad(w, rows: int, cols: int | None = None):
    """``w`` (numpy or torch, [r] or [r, c]) zero-padded to ``rows`` (and ``cols``)."""
    pad_r = rows - w.shape[0]
    pad_c = 0 if cols is None else cols - w.shape[1]
    if not pad_r and not pad_c:
        return w
    if _is_torch(w):
        import torch.nn.functional as F

        return F.pad(w, (0, pad_c, 0, pad_r) if w.ndim == 2 else (0, pad_r))
    from engine.backends.cuda.weights import dequantized

    w = np.asarray(dequantized(w), dtype=np.float32)  # bf16 kept as stored (engine.loaders.bf16) widened first
    return np.pad(w, ((0, pad_r), (0, pad_c)) if w.ndim == 2 else ((0, pad_r),))


class VisionTower:
    """The tower's weights and workspace on the device, and ``encode``."""

    def __init__(self, cfg: VisionConfig, weights, mem, kern, cache_dir: str = "",
                 max_patches: int = MAX_PATCHES, vk=None) -> None:  # fmt: skip
        import pycuda.driver as cuda

        from engine.backends.cuda.weights import _Uploader
        from engine.cu.vision import VIS_QUERY_ROWS, VisionKernels

        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"vision hidden_size {cfg.hidden_size} is not whole heads of {cfg.num_heads}")
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r}: the CUDA tower runs silu only")
        self.cfg, self.kern, self.mem = cfg, kern, mem
        self.vk = vk or VisionKernels(cfg.head_dim, cache_dir)  # vk: built by the caller (compiling meanwhile)
        self.max_patches = max_patches = max_patches // cfg.spatial_merge_size**2 * cfg.spatial_merge_size**2
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        self.ip = ip = -(-inter // 8) * 8
        self.nbytes = 0

        def up(fp32: bool = False, **parts) -> int:
            u = _Uploader(parts, mem)
            ptr = u(list(parts), fp32=fp32)
            self.nbytes += u.nbytes
            return ptr

        def w(name: str):
            return weights[name]

        self.patch_embed = up(w=w("visual.patch_embed.proj.weight"))
        self.blocks = []
        for n in range(cfg.depth):
            p = f"visual.blocks.{n}."
            self.blocks.append(_Block(
                norm1=up(w=w(p + "norm1.weight")), norm2=up(w=w(p + "norm2.weight")),
                qkv=up(w=w(p + "attn.qkv.weight")), qkv_b=up(True, b=w(p + "attn.qkv.bias")),
                proj=up(w=w(p + "attn.proj.weight")), proj_b=up(True, b=w(p + "attn.proj.bias")),
                gate_up=up(g=_pad(w(p + "mlp.gate_proj.weight"), ip), u=_pad(w(p + "mlp.up_proj.weight"), ip)),
                gate_up_b=up(True, g=_pad(w(p + "mlp.gate_proj.bias"), ip), u=_pad(w(p + "mlp.up_proj.bias"), ip)),
                down=up(w=_pad(w(p + "mlp.down_proj.weight"), hid, ip)), down_b=up(True, b=w(p + "mlp.down_proj.bias")),
            ))  # fmt: skip
        self.ln_q = up(w=w("visual.merger.ln_q.weight"))
        self.mlp0, self.mlp0_b = up(w=w("visual.merger.mlp.0.weight")), up(True, b=w("visual.merger.mlp.0.bias"))
        self.mlp2, self.mlp2_b = up(w=w("visual.merger.mlp.2.weight")), up(True, b=w("visual.merger.mlp.2.bias"))
        half = cfg.head_dim // 2  # the numpy tower's frequencies: h rotates the first half of the pairs, w the second
        inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, half, 2, dtype=np.float32) / half))).astype(
            np.float32
        )
        self.inv_freq = mem.alloc(inv.nbytes)
        cuda.memcpy_htod(self.inv_freq, inv)
        self.nbytes += inv.nbytes

        N, pd, out = max_patches, cfg.patch_dim, cfg.out_hidden_size
        max_tiles = N // 4 + N // VIS_QUERY_ROWS + 8  # a window holds at least one merge block (4 rows)
        sizes = {
            "x": N * hid * 4, "xn": N * hid * 2, "qkv": N * 3 * hid * 4, "q": N * hid * 2, "k": N * hid * 2,
            "v": N * hid * 2, "attn": N * hid * 2, "gu": N * max(2 * ip, pd) * 4, "act": N * max(ip, pd) * 2,
            "y": N // 4 * out * 4, "out": N // 4 * out * 4, "idx": N * 4, "hw": N * 8, "inv": N // 4 * 4,
            "tiles_w": max_tiles * 16, "tiles_f": max_tiles * 16,
        }  # fmt: skip
        self.ws = {name: mem.alloc(nb) for name, nb in sizes.items()}
        self.workspace_bytes = sum(sizes.values())

    def encode(self, s, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        """float32 [t*h*w / merge**2, out_hidden_size]: one image's placeholder rows in prompt order
        (waits for the stream)."""
        import pycuda.driver as cuda

        cfg, k, vk, ws = self.cfg, self.kern, self.vk, self.ws
        unit = cfg.spatial_merge_size**2
        n = int(np.prod(grid_thw))
        if n > self.max_patches:
            raise ValueError(f"an image of {n} patches; the CUDA tower takes up to {self.max_patches}")
        hid, heads, ip, eps, pd = cfg.hidden_size, cfg.num_heads, self.ip, cfg.rms_norm_eps, cfg.patch_dim
        from engine.cu.vision import attention_tiles

        index, windows = window_index(grid_thw, cfg)
        order = (index[:, None] * unit + np.arange(unit)).reshape(-1)
        hw = rotary_positions(grid_thw, cfg.spatial_merge_size)[order]
        qrows = vk.query_rows
        tiles = {"tiles_w": attention_tiles(windows, qrows), "tiles_f": attention_tiles(frame_bounds(grid_thw), qrows)}
        # Synchronous copies on the legacy stream: they wait for earlier work on ``s`` (a blocking stream).
        cuda.memcpy_htod(ws["gu"], np.ascontiguousarray(pixel_values, dtype=np.float32))
        cuda.memcpy_htod(ws["idx"], order.astype(np.int32))
        cuda.memcpy_htod(ws["hw"], np.ascontiguousarray(hw, dtype=np.int32))
        cuda.memcpy_htod(ws["inv"], np.argsort(index).astype(np.int32))
        for name, t in tiles.items():
            cuda.memcpy_htod(ws[name], t)
        vk.gather(s, ws["gu"], ws["idx"], ws["act"], n, pd, to_bf16=True)
        x, xn, qkv, attn, gu, act = ws["x"], ws["xn"], ws["qkv"], ws["attn"], ws["gu"], ws["act"]
        k.linear(s, act, self.patch_embed, 0, x, n, hid, pd)
        for i, b in enumerate(self.blocks):
            which = "tiles_f" if i in cfg.fullatt_block_indexes else "tiles_w"
            k.rmsnorm(s, x, b.norm1, xn, n, hid, eps)
            k.linear(s, xn, b.qkv, b.qkv_b, qkv, n, 3 * hid, hid)
            vk.qkv_rope(s, qkv, ws["hw"], self.inv_freq, ws["q"], ws["k"], ws["v"], n, heads)
            vk.attention(s, ws["q"], ws["k"], ws["v"], ws[which], len(tiles[which]), attn, n, heads)
            k.linear(s, attn, b.proj, b.proj_b, x, n, hid, hid, accumulate=True)
            k.rmsnorm(s, x, b.norm2, xn, n, hid, eps)
            k.linear(s, xn, b.gate_up, b.gate_up_b, gu, n, 2 * ip, hid)
            k.swiglu(s, gu, act, ip, n)
            k.linear(s, act, b.down, b.down_b, x, n, hid, ip, accumulate=True)
        rows, wide, out = n // unit, hid * unit, cfg.out_hidden_size
        k.rmsnorm(s, x, self.ln_q, xn, n, hid, eps)  # xn as [rows, 4 * hidden]: each merge block's 4 rows
        k.linear(s, xn, self.mlp0, self.mlp0_b, qkv, rows, wide, wide)
        vk.gelu(s, qkv, attn, rows * wide)
        k.linear(s, attn, self.mlp2, self.mlp2_b, ws["y"], rows, out, wide)
        vk.gather(s, ws["y"], ws["inv"], ws["out"], rows, out, to_bf16=False)
        host = np.empty((rows, out), dtype=np.float32)
        s.synchronize()
        cuda.memcpy_dtoh(host, ws["out"])
        return host
