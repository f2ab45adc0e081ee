"""The fp8 parts as the CUDA backend uploads them (engine/backends/cuda/weights.py's fp8_part), on the
CPU: read back the way gemv_q.cu reads them (w[n, k] = decode(byte) * scale, FP8: a scale a row, FP8B:
a row of scales a row, one a 128 columns), they give the checkpoint's dequantized values bit for bit,
through the row permutations of q|k|v (rope) and gate|up; the byte counts are quant.row_bytes'."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cuda import weights
from engine.backends.cuda.weights import check_fp8, fp8_part, fp8_readable, interleave_gate_up, interleave_rope
from engine.cu.quant import FP8, FP8_BLOCK, FP8B, row_bytes
from engine.loaders.fp8 import decode, quantize_fp8


def read_back(fmt: str, a: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """float32 [rows, k] as gemv_q.cu's main loop and dequant weigh the part's values."""
    rows, k = a.shape
    if fmt == FP8:
        return decode(a) * sc.reshape(rows, 1)
    kb = -(-k // FP8_BLOCK)
    return decode(a) * sc.reshape(rows, kb)[:, np.arange(k) // FP8_BLOCK]


def _tiles(rng, rows, k, block):
    # columns of very different magnitude, so a scale taken from the wrong tile changes the values
    w = rng.standard_normal((rows, k)) * rng.uniform(0.01, 4, (1, k)) * rng.uniform(0.1, 2, (rows, 1))
    return quantize_fp8(w.astype(np.float32), block)


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("rows,k", [(128, 128), (200, 336), (16, 64), (300, 4096)])
def test_part_reads_back_as_the_checkpoint(rows, k, block):
    q = _tiles(np.random.default_rng(rows * k), rows, k, block)
    fmt, a, sc = fp8_part([q])
    assert fmt == (FP8 if block is None else FP8B)
    assert a.nbytes + sc.nbytes == rows * row_bytes(fmt, k)
    np.testing.assert_array_equal(read_back(fmt, a, sc).view(np.uint32), q.dequantize().view(np.uint32))


@pytest.mark.parametrize("block", [None, 128])
def test_rope_and_gate_up_permute_the_scales_with_their_rows(block):
    rng = np.random.default_rng(3)
    d, k = 64, 384
    q_, k_ = _tiles(rng, 4 * d, k, block), _tiles(rng, 2 * d, k, block)
    fmt, a, sc = fp8_part([q_, k_], rope_dim=d)
    want = interleave_rope(np.concatenate([q_.dequantize(), k_.dequantize()]), d)
    np.testing.assert_array_equal(read_back(fmt, a, sc), want)
    gate, up = _tiles(rng, 200, k, block), _tiles(rng, 200, k, block)
    fmt, a, sc = fp8_part([gate, up], interleave=True)
    np.testing.assert_array_equal(read_back(fmt, a, sc), interleave_gate_up(gate.dequantize(), up.dequantize()))


def test_what_the_gemv_does_not_read_goes_up_as_bf16():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="64x64 block scales.*weight_format bf16"):
        check_fp8([quantize_fp8(w, 64)])
    assert not fp8_readable([quantize_fp8(w), quantize_fp8(w, 128)])  # one matrix of both kinds
    assert not fp8_readable([quantize_fp8(w[:, :200])])  # K % 16
    assert fp8_readable([quantize_fp8(w, 128), quantize_fp8(w, 128)]) and fp8_readable([quantize_fp8(w)])


def test_quant_formats_names_each_fp8_kind_present():
    w = np.random.default_rng(6).standard_normal((128, 128)).astype(np.float32)
    assert weights.quant_formats({"a": quantize_fp8(w)}) == (FP8,)
    assert weights.quant_formats({"a": quantize_fp8(w, 128)}) == (FP8B,)
    both = {"a": quantize_fp8(w), "b": quantize_fp8(w, 128), "c": quantize_fp8(w, 64)}
    assert weights.quant_formats(both) == (FP8, FP8B)
