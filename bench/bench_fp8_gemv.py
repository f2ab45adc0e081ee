"""Bandwidth of engine/cu/gemv_fp8.cu (fp8 e4m3 weights, per-channel scales) on Llama-3.1-8B's MLP
shapes, beside the bf16 tensor-core GEMV (gemv.cu's gemv_tc) on the same shapes.

Each timed launch reads a different copy of the matrix (more copies than L2 holds), so every
figure streams its weights from HBM; the ceiling is a plain streaming read. Prints the machine,
the command and the date with the table (docs/QUANT.md keeps the numbers).

    python3 bench/bench_fp8_gemv.py [--variants 4,1 2,2 4,2]   (unroll,chunks pairs)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {"down_proj": (4096, 14336), "gate|up": (14336, 4096)}  # [out, in]
COPIES = 6  # > L2 (50 MB) / the smallest matrix
REPS = 30


SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def timed(cuda, stream, launch, reps: int = REPS) -> float:
    """Seconds of one launch, the device's time alone: a spin kernel holds the stream while ``reps``
    launches (``launch(i)`` runs copy ``i % COPIES``) queue up behind it between two events, so
    the host's launch latency is not counted. Median of 5 such runs, after a warm-up."""
    from pycuda.compiler import SourceModule

    spin = SourceModule(SPIN, no_extern_c=True, arch="sm_90").get_function("spin")
    for i in range(COPIES):
        launch(i)
    times = []
    for _ in range(5):
        a, b = cuda.Event(), cuda.Event()
        spin(np.int64(4_000_000), block=(1, 1, 1), grid=(1, 1), stream=stream)  # ~2 ms at 1.98 GHz
        a.record(stream)
        for i in range(reps):
            launch(i)
        b.record(stream)
        b.synchronize()
        times.append(b.time_since(a) / 1e3 / reps)
    return statistics.median(times)


def bench_shape(cuda, ga, stream, tc, n: int, k: int, variants):
    """``(kernel, rows, seconds, weight bytes)`` for each kernel at rows 1 and 8 on ``[n, k]``
    (``tc``: gemv.cu's gemv_tc_store, fp32 out)."""
    from tests.kernels.test_cuda_fp8 import gemv_fp8, load_gemv_fp8

    rng = np.random.default_rng(0)
    w8 = [ga.to_gpu(rng.integers(0, 0x7E, (n, k), dtype=np.uint8)) for _ in range(COPIES)]
    scale = ga.to_gpu(np.full(n, 1e-2, np.float32))
    wbf = [ga.to_gpu(np.full((n, k), 0x3C00, np.uint16)) for _ in range(COPIES)]
    x = ga.to_gpu(np.full((8, k), 0x3F80, np.uint16))
    y, yf = ga.empty((8, n), np.uint16), ga.empty((8, n), np.float32)
    out = []
    for rows in (1, 8):
        for unroll, chunks in variants:
            kern = load_gemv_fp8(unroll, chunks)

            def fp8(i, kern=kern, rows=rows):
                gemv_fp8(kern, stream, x.gpudata, w8[i % COPIES].gpudata, scale.gpudata, y.gpudata, rows, n, k)

            out.append((f"fp8 gemv_fp8 (unroll {unroll}, chunks {chunks})", rows, timed(cuda, stream, fp8), n * k))

        def bf16(i, rows=rows):
            tc(stream, ((n + 15) // 16,), x=x.gpudata, W=wbf[i % COPIES].gpudata, bias=0, out=yf.gpudata, M=rows,
               N=n, K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0)  # fmt: skip

        out.append(("bf16 gemv_tc", rows, timed(cuda, stream, bf16), 2 * n * k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["4,1", "2,2"], help="unroll,chunks pairs")
    args = ap.parse_args()
    variants = [tuple(int(v) for v in pair.split(",")) for pair in args.variants]

    from bench.bench_cuda import read_bandwidth
    from engine.cu import runtime
    from engine.cu.kernels import STORE, TC_PARAMS, TC_THREADS
    from engine.cu.launch import Kernel, module

    with runtime.current():
        import pycuda.driver as cuda
        import pycuda.gpuarray as ga

        stream = cuda.Stream()
        ceiling = read_bandwidth(cuda, stream, nbytes=4 << 30)
        dev = cuda.Context.get_device()
        print(f"# {dev.name()} ({platform.node()}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(f"# python3 bench/bench_fp8_gemv.py --variants {' '.join(args.variants)}")
        print(f"# streaming read ceiling: {ceiling / 1e9:.0f} GB/s")
        print("| shape [out, in] | kernel | rows | us | weight GB/s | of ceiling |")
        print("| --- | --- | --- | --- | --- | --- |")
        tc = Kernel(module("gemv", (("TC_THREADS", TC_THREADS),)), "gemv_tc_store", TC_PARAMS[STORE], TC_THREADS)
        for label, (n, k) in SHAPES.items():
            for row in bench_shape(cuda, ga, stream, tc, n, k, variants):
                kernel, rows, t, nbytes = row
                print(f"| {label} [{n}, {k}] | {kernel} | {rows} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
                      f"{nbytes / t / ceiling:.0%} |")  # fmt: skip
            sys.stdout.flush()


if __name__ == "__main__":
    main()
