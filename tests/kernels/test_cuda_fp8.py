"""engine/cu/gemv_fp8.cu against numpy: y = bf16(scale * x @ decode(W).T) for fp8 e4m3 weights with
per-output-channel scales (engine/loaders/fp8.py's quantization), rows 1..8, fresh random inputs of
several shapes. Skipped without PyCUDA and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from engine.loaders.fp8 import decode, quantize_fp8
from tests.kernels.gpu import requires_cuda

pytestmark = requires_cuda
THREADS = 256


def load_gemv_fp8(unroll: int = 4, chunks: int = 1):
    """The kernel through engine/cu/launch.py's loader (kernels.py does not declare it yet)."""
    from engine.cu.launch import Kernel, module

    mod = module("gemv_fp8", (("FP8_THREADS", THREADS), ("FP8_UNROLL", unroll), ("FP8_CHUNKS", chunks)))
    return Kernel(mod, "gemv_fp8", "x:ptr W:ptr scale:ptr y:ptr M:i32 N:i32 K:i32", THREADS)


def gemv_fp8(kernel, stream, x, w, scale, y, rows: int, n: int, k: int) -> None:
    """y[rows, n] bf16 = x[rows, k] bf16 @ W[n, k].T (e4m3 bytes) * scale[n]; checks the preconditions."""
    if k % 16 or not 1 <= rows <= 8:
        raise ValueError(f"gemv_fp8: K={k} must be a multiple of 16 and rows={rows} in 1..8")
    kernel(stream, ((n + 15) // 16,), x=x, W=w, scale=scale, y=y, M=rows, N=n, K=k)


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module", params=[(4, 1), (2, 2)], ids=["u4c1", "u2c2"])
def kernel(dev, request):
    return load_gemv_fp8(*request.param)


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def _from_bf16(a: np.ndarray, shape) -> np.ndarray:
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def _run(dev, kernel, x: np.ndarray, q, rows: int) -> np.ndarray:
    import pycuda.gpuarray as ga

    n, k = q.shape
    xs = ga.to_gpu(_bf16(x[:rows]))
    ws, ss = ga.to_gpu(q.data), ga.to_gpu(q.scale)
    ys = ga.to_gpu(np.full(8 * n, 0x7FC0, np.uint16))  # bf16 NaN: rows >= M must stay untouched
    stream = dev.Stream()
    gemv_fp8(kernel, stream, xs.gpudata, ws.gpudata, ss.gpudata, ys.gpudata, rows, n, k)
    stream.synchronize()
    out = ys.get()
    assert np.all(out[rows * n :] == 0x7FC0)
    return _from_bf16(out[: rows * n], (rows, n))


@pytest.mark.parametrize("n,k", [(16, 64), (40, 208), (300, 1024), (1000, 4096)])
def test_gemv_fp8_matches_numpy_at_every_width(dev, kernel, n, k):
    rng = np.random.default_rng()
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2, (n, 1)).astype(np.float32)
    q = quantize_fp8(w)
    x = _from_bf16(_bf16(rng.standard_normal((8, k)) * 3), (8, k))
    wq = decode(q.data).astype(np.float64)
    ref = (x.astype(np.float64) @ wq.T) * q.scale
    bound = (np.abs(x).astype(np.float64) @ np.abs(wq).T) * q.scale
    full = _run(dev, kernel, x, q, 8)
    for rows in range(1, 9):
        y = _run(dev, kernel, x, q, rows)
        # bf16 rounding of the output, plus fp32 accumulation over k terms.
        assert np.all(np.abs(y - ref[:rows]) <= 2.0**-8 * np.abs(ref[:rows]) + 1e-6 * bound[:rows]), rows
        # A row's result does not depend on the width of its round.
        assert np.array_equal(y, full[:rows]), rows


def test_gemv_fp8_refuses_a_k_off_its_vector_width(kernel):
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv_fp8(kernel, None, 0, 0, 0, 0, 1, 16, 24)
