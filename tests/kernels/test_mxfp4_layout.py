"""The MXFP4 blobs the CUDA backend uploads (engine/cu/mxfp4.py), checked on the CPU: read back as the
kernels read them they hold the checkpoint's values, rows in the bf16 pools' gate|up order."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cu import mxfp4
from engine.loaders.mxfp4 import E2M1, Mxfp4Tensor

rng = np.random.default_rng(5)


def tensor(rows: int, cols: int) -> Mxfp4Tensor:
    g = cols // 32
    return Mxfp4Tensor(rng.integers(0, 256, (rows, g, 16), dtype=np.uint8),
                       rng.integers(100, 140, (rows, g), dtype=np.uint8))  # fmt: skip


@pytest.mark.parametrize("rows,cols", [(16, 2880), (3, 32), (8, 128), (5, 288)])
def test_blob_reads_back_as_the_checkpoint_values(rows, cols):
    t = tensor(rows, cols)
    blob = mxfp4.pack(t.blocks, t.scales)
    assert blob.size == mxfp4.blob_bytes(rows, cols) and blob.size % mxfp4.BLOB_ALIGN == 0
    np.testing.assert_array_equal(mxfp4.unpack(blob, rows, cols), t.dequantize())


def test_blob_layout_of_one_group():
    """Row 0, group 0: lane t's u32 j holds values 8t.. of block j, nibble i value NIBBLE_ORDER[i]."""
    t = tensor(1, 128)
    blob = mxfp4.pack(t.blocks, t.scales)
    codes = np.stack([t.blocks & 0xF, t.blocks >> 4], -1).reshape(4, 32)  # [block, value]
    words = blob[:64].view("<u4").reshape(4, 4)  # [lane t, block j]
    for lane in range(4):
        for j in range(4):
            got = [(int(words[lane, j]) >> (4 * i)) & 0xF for i in range(8)]
            assert got == [codes[j, 8 * lane + v] for v in mxfp4.NIBBLE_ORDER]
    np.testing.assert_array_equal(blob[64:68], t.scales[0])  # the scales follow the nibbles


def test_the_pack_kernels_nibble_swap_gives_the_blob_words():
    """moe_mx_pack's two delta swaps in numpy: a checkpoint u32 (values v0..v7, HF's order) becomes the
    blob's (v0 v2 v4 v6 v1 v3 v5 v7)."""
    t = tensor(2, 128)
    x = t.blocks.view("<u4").reshape(2, 4, 4).astype(np.uint32)  # [row, block j, lane t]
    d = (x ^ (x >> 4)) & 0x00F000F0
    x = x ^ d ^ (d << 4)
    d = (x ^ (x >> 8)) & 0x0000FF00
    x = x ^ d ^ (d << 8)
    words = mxfp4.pack(t.blocks, t.scales)[:128].view("<u4").reshape(2, 4, 4)  # [row, lane t, block j]
    np.testing.assert_array_equal(x.transpose(0, 2, 1), words)


def test_the_kernels_bit_decode_gives_the_values():
    """moe_gemv.cu's mx_decode in numpy: per u32, pair j's magnitude bits shifted to bf16 bits 8..6 and
    sign to bit 15 (both halves), times 2^126, are the e2m1 values (v2j, v2j+1) unscaled."""
    t = tensor(4, 256)
    blob = mxfp4.pack(t.blocks, np.full_like(t.scales, 127))  # scale 1
    words = blob[: 4 * 256 // 2].view("<u4").astype(np.uint64)
    m, s = 0x01C001C0, 0x80008000
    shifts = [(6, 12), (2, 8), (-2, 4), (-6, 0)]  # (magnitude, sign) left shifts of pair j

    def shl(q, n):
        return (q << n if n >= 0 else q >> -n) & 0xFFFFFFFF

    pairs = np.stack([(shl(words, a) & m) | (shl(words, b) & s) for a, b in shifts], -1)  # [words, j]
    lo = ((pairs & 0xFFFF) << 16).astype(np.uint32).view(np.float32) * np.float32(2.0**126)
    hi = (pairs & 0xFFFF0000).astype(np.uint32).view(np.float32) * np.float32(2.0**126)
    values = np.stack([lo, hi], -1).reshape(4, 2, 4, 4, 8)  # [row, group, lane t, block j, 8 values]
    got = values.transpose(0, 1, 3, 2, 4).reshape(4, 256)
    np.testing.assert_array_equal(got, mxfp4.unpack(blob, 4, 256))


@pytest.mark.parametrize("rows,cols", [(5, 288), (16, 128)])
def test_the_gemm_tiles_reading_gives_the_values(rows, cols):
    """moe_gemm.cu's MOE_MX loads in numpy: k-tile kt (block b = kt of the row; group G = b / 4, j = b % 4)
    reads lane ch's nibble word at row * Kp / 2 + 64 G + 16 ch + 4 j and the scale word at the scales +
    row * Kp / 32 + 4 G (byte j); word ch's 8 values are the tile's k = 8 ch .. 8 ch + 7."""
    t = tensor(rows, cols)
    blob = mxfp4.pack(t.blocks, t.scales)
    kp = mxfp4.padded_k(cols)
    s0 = rows * kp // 2

    def u32(off: int) -> int:
        assert off % 4 == 0  # the 4-byte cp.async's alignment
        return int(blob[off : off + 4].view("<u4")[0])

    got = np.zeros((rows, cols), np.float32)
    for row in range(rows):
        for kt in range(cols // 32):
            g, j = kt // 4, kt % 4
            scale = (u32(s0 + row * kp // 32 + 4 * g) >> (8 * j)) & 0xFF
            for ch in range(4):
                w = u32(row * kp // 2 + 64 * g + 16 * ch + 4 * j)
                codes = [(w >> (4 * i)) & 0xF for i in range(8)]  # nibble i holds value NIBBLE_ORDER[i]
                for i, v in enumerate(mxfp4.NIBBLE_ORDER):
                    got[row, 32 * kt + 8 * ch + v] = np.ldexp(E2M1[codes[i]], scale - 127)
    np.testing.assert_array_equal(got, t.dequantize())
