"""The fp8 decode GEMV (gemv_q.cu's FP8 format) against gemv_tc's bf16 on the Llama-3.1-8B matrices.

Times the store epilogue at width 1 (CUDA events, median of 50 calls, each over a fresh copy of the
weights so nothing is served from L2) for several (steps in flight, blocks per SM) tunings, and the
128 x 128 tile-scaled FP8B at its default tuning, and prints microseconds and the achieved read
bandwidth (of the e4m3 bytes). Needs a CUDA device; prints a table.
"""

from __future__ import annotations

import statistics

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TUNINGS = [(4, 2, 1), (8, 2, 1), (2, 4, 1), (4, 3, 1)]  # (QU, QMINB, QNST unused by FP8)
COPIES = 4


def timed(cuda, stream, launch, reps: int = 50) -> float:
    a, b = cuda.Event(), cuda.Event()
    ts = []
    for r in range(reps):
        a.record(stream)
        launch(r % COPIES)
        b.record(stream)
        b.synchronize()
        ts.append(b.time_since(a) / 1e3)
    return statistics.median(ts[5:])


def launcher(kernel, s, n: int, x, weights: list, common: dict):
    return lambda i: kernel(s, ((n + 15) // 16,), x=x, W=weights[i], **common)


def main() -> None:
    import pycuda.driver as cuda

    from engine.cu import runtime
    from engine.cu.kernels import TC_PARAMS, Kernels
    from engine.cu.quant import FP8, FP8B, QuantKernels, row_bytes

    with runtime.current():
        s = cuda.Stream()
        kern = Kernels(128, 4)
        x = cuda.mem_alloc(2 * 8 * 14336)
        cuda.memset_d16(x, 0x3C00, 8 * 14336)
        out = cuda.mem_alloc(4 * 8 * 28672)
        rows = []
        quants = {t: QuantKernels(FP8, TC_PARAMS, tuning=t) for t in TUNINGS}
        tiles = QuantKernels(FP8B, TC_PARAMS)
        for name, (n, k) in SHAPES.items():
            bf = [cuda.mem_alloc(2 * n * k) for _ in range(COPIES)]
            f8 = [cuda.mem_alloc(n * row_bytes(FP8, k)) for _ in range(COPIES)]
            f8b = [cuda.mem_alloc(n * row_bytes(FP8B, k)) for _ in range(COPIES)]
            for b in bf:
                cuda.memset_d16(b, 0x3C00, n * k)
            for f, scales in [(f, n) for f in f8] + [(f, n * (row_bytes(FP8B, k) - k) // 4) for f in f8b]:
                cuda.memset_d8(f, 0x38, n * k)
                cuda.memset_d32(int(f) + n * k, 0x3F800000, scales)
            common = dict(out=out, M=1, N=n, K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, bias=0, nw=0, xw=0, ss_out=0)
            tc = kern._tc[("store", n * k < kern.u2_below)]
            t_bf = timed(cuda, s, launcher(tc, s, n, x, bf, common))
            cells = [f"{name} {n}x{k}", f"bf16 {t_bf * 1e6:.1f} us ({2 * n * k / t_bf / 1e12:.2f} TB/s)"]
            for t, q in quants.items():
                tf = timed(cuda, s, launcher(q.gemv["store"], s, n, x, f8, common))
                cells.append(f"fp8 {t}: {tf * 1e6:.1f} us ({n * k / tf / 1e12:.2f} TB/s, {tf / t_bf:.2f}x)")
            tb = timed(cuda, s, launcher(tiles.gemv["store"], s, n, x, f8b, common))
            cells.append(f"fp8 128x128 tiles: {tb * 1e6:.1f} us ({n * k / tb / 1e12:.2f} TB/s, {tb / t_bf:.2f}x)")
            rows.append(" | ".join(cells))
            for b in bf + f8 + f8b:
                b.free()
        print("\n".join(rows))


if __name__ == "__main__":
    main()
