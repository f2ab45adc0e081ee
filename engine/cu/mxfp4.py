"""MXFP4 expert matrices as the CUDA backend stores them (moe_gemv.cu's ``MOE_MX`` build reads them).

A matrix ``[N, K]`` of e2m1 values with one e8m0 scale per 32 (``engine.loaders.mxfp4``) goes up
as one byte blob, ``blob_bytes(N, K)`` long:

* nibbles ``[N, Kp / 2]`` (``Kp`` = K rounded up to 128, the tail zero): each row in groups of 128
  values (64 bytes); in group ``G`` lane ``t`` (0..3) of a warp's quad reads 16 bytes at ``16 t``,
  whose u32 ``j`` holds values ``8 t .. 8 t + 7`` of block ``4 G + j`` in the nibble order
  ``NIBBLE_ORDER`` (nibble ``i`` holds value ``NIBBLE_ORDER[i]``: v0 v2 v4 v6 v1 v3 v5 v7), so the
  pair ``(v2j, v2j+1)`` sits at bits ``4j`` and ``16 + 4j`` and unpacks to a bf16x2 with two shifts
  and two masks;
* then scales ``[N, Kp / 32]`` (the tail's 0).

One 16-byte load a lane brings 4 blocks' 8 values of a row, and the 4 lanes of a quad read one
block at a time, so an mma's 16 k values share one scale per row (applied to its fp32 sums).
:func:`unpack` is the kernel's reading in numpy (the CPU tests' check of the packing).
"""

from __future__ import annotations

import numpy as np

from engine.loaders.mxfp4 import E2M1

GROUP = 128  # values a row group (4 blocks of 32)
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BLOB_ALIGN = 256  # an expert's blob starts 256-byte aligned (its 16-byte loads and u32 scale loads)


def padded_k(k: int) -> int:
    return -(-k // GROUP) * GROUP


def blob_bytes(n: int, k: int) -> int:
    """Bytes of one ``[n, k]`` matrix's blob, rounded up to ``BLOB_ALIGN``."""
    kp = padded_k(k)
    return -(-(n * kp // 2 + n * kp // 32) // BLOB_ALIGN) * BLOB_ALIGN


def pack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``blocks`` uint8 ``[N, K / 32, 16]`` (HF's nibble order: byte j holds values 2j, 2j + 1) and
    ``scales`` uint8 ``[N, K / 32]`` -> the blob, uint8 ``[blob_bytes(N, K)]``."""
    n, g, _ = blocks.shape
    k, kp = g * 32, padded_k(g * 32)
    values = np.zeros((n, kp // 32, 32), np.uint8)  # nibble codes, one a byte
    values[:, :g, 0::2] = blocks & 0x0F
    values[:, :g, 1::2] = blocks >> 4
    # [n, group, block j, lane t, 8 values] -> [n, group, t, j, nibble i] in NIBBLE_ORDER
    v = values.reshape(n, kp // GROUP, 4, 4, 8).transpose(0, 1, 3, 2, 4)[..., list(NIBBLE_ORDER)]
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(8):
        words |= v[..., i].astype(np.uint32) << np.uint32(4 * i)
    out = np.zeros(blob_bytes(n, k), np.uint8)
    out[: n * kp // 2] = words.astype("<u4").reshape(-1).view(np.uint8)
    sc = np.zeros((n, kp // 32), np.uint8)
    sc[:, :g] = scales
    out[n * kp // 2 : n * kp // 2 + sc.size] = sc.reshape(-1)
    return out


def unpack(blob: np.ndarray, n: int, k: int) -> np.ndarray:
    """float32 ``[n, k]``: the values a blob holds, read as the kernels read it."""
    kp = padded_k(k)
    words = blob[: n * kp // 2].view("<u4").reshape(n, kp // GROUP, 4, 4)  # [n, group, t, j]
    codes = np.stack([(words >> np.uint32(4 * i)) & 0xF for i in range(8)], -1)
    values = np.empty_like(codes)
    values[..., list(NIBBLE_ORDER)] = codes
    values = values.transpose(0, 1, 3, 2, 4).reshape(n, kp)  # [n, group, j, t, 8]
    sc = blob[n * kp // 2 : n * kp // 2 + n * kp // 32].reshape(n, kp // 32).astype(np.int32)
    with np.errstate(over="ignore"):
        out = np.ldexp(E2M1[values].reshape(n, kp // 32, 32), (sc - 127)[..., None]).reshape(n, kp)
    return out[:, :k]
