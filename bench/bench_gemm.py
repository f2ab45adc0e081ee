"""Benchmark of the prefill GEMMs on the Llama-3.1-8B shapes: gemm_hopper (wgmma + TMA,
engine/cu/hopper.py) beside gemm_bf16 (mma.sync, engine/cu/gemm.cu) and torch.matmul (cuBLAS).

Shapes (N x K): q,k,v 6144 x 4096, o 4096 x 4096, gate,up 28672 x 4096, down 4096 x 14336, each
at M = 16, 128, 1024, 2048, 8192 rows; random bf16 operands. Each figure is the median of
``--reps`` launches timed by CUDA events, each after L2 was flushed (a 256 MB memset), in
TFLOP/s of 2 M N K. Ours write fp32 C (the forward pass's contract), cuBLAS bf16 C. With
``--variants`` every gemm_hopper tile variant is timed too (what ``HopperGemm.pick`` is tuned on),
the narrow ones (64 x 32 .. 128 x 64, for a few rows) included.

    python3 bench/bench_gemm.py --write
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import perfdoc  # noqa: E402

SECTION = "## Hopper GEMM (H200, Llama-3.1-8B prefill shapes)"
SHAPES = (("q,k,v", 6144, 4096), ("o", 4096, 4096), ("gate,up", 28672, 4096), ("down", 4096, 14336))
ROWS = (16, 128, 1024, 2048, 8192)
LAYERS = 32
FLUSH_BYTES = 256 << 20


def median_ms(launch, record, sync, flush, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        launch()
    times = []
    for _ in range(reps):
        flush()
        start, end = record(), None
        launch()
        end = record()
        sync(end)
        times.append(start.time_till(end) if hasattr(start, "time_till") else start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--variants", action="store_true", help="time every gemm_hopper tile variant too")
    ap.add_argument("--write", action="store_true", help="write the table into docs/PERFORMANCE.md")
    args = ap.parse_args()

    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda
        import torch

        from engine.cu.hopper import HopperGemm
        from engine.cu.kernels import GEMM_SMEM, GEMM_THREADS
        from engine.cu.launch import Kernel, module

        torch.backends.cuda.matmul.allow_tf32 = False
        hg = HopperGemm()
        old = Kernel(module("gemm", (("GEMM_THREADS", GEMM_THREADS),)), "gemm_bf16", "A:ptr W:ptr bias:ptr C:ptr "
                     "M:i32 N:i32 K:i32 ldc:i32 accumulate:i32", GEMM_THREADS, shared=GEMM_SMEM)  # fmt: skip
        old.fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, GEMM_SMEM)
        s = cuda.Stream()
        flush_buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

        def pyc(launch):
            return median_ms(launch, lambda: _ev(cuda, s), lambda e: e.synchronize(),
                             lambda: cuda.memset_d32_async(flush_buf.data_ptr(), 0, FLUSH_BYTES // 4, s),
                             args.reps)  # fmt: skip

        def tor(launch):
            def rec():
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                return e

            return median_ms(launch, rec, lambda e: e.synchronize(), flush_buf.zero_, args.reps)

        gen = torch.Generator(device="cuda").manual_seed(0)
        rows = sorted(args.rows)
        mmax = rows[-1]
        table = ["| matrix (N x K) | M | gemm_bf16 | gemm_hopper (tile) | cuBLAS | hopper / cuBLAS |",
                 "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        var_lines = ["| matrix | M | " + " | ".join(f"{64 * nc}x{bn}" for nc, bn in hg.variants) + " |",
                     "|---|---:|" + "---:|" * len(hg.variants)]  # fmt: skip
        chunk = {"gemm_bf16": 0.0, "gemm_hopper": 0.0, "cuBLAS": 0.0}

        def measure(name: str, n: int, k: int, m: int, a, w, c) -> None:
            flop = 2.0 * m * n * k
            t_old = pyc(lambda: old(s, ((m + 127) // 128, (n + 127) // 128), A=a.data_ptr(), W=w.data_ptr(), bias=0,
                                    C=c.data_ptr(), M=m, N=n, K=k, ldc=n, accumulate=0))  # fmt: skip
            t_new = pyc(lambda: hg(s, a.data_ptr(), w.data_ptr(), 0, c.data_ptr(), m, n, k))
            t_cub = tor(lambda: torch.matmul(a, w.t()))
            nc, bn = hg.pick(m, n)
            tf = [flop / t / 1e9 for t in (t_old, t_new, t_cub)]
            table.append(f"| {name} {n} x {k} | {m} | {tf[0]:.0f} | {tf[1]:.0f} ({64 * nc}x{bn}) | {tf[2]:.0f} "
                         f"| {tf[1] / tf[2]:.0%} |")  # fmt: skip
            print(table[-1], flush=True)
            if m == 2048:
                for key, t in zip(chunk, (t_old, t_new, t_cub), strict=True):
                    chunk[key] += t * LAYERS
            if args.variants:
                vt = [flop / pyc(lambda v=v: hg(s, a.data_ptr(), w.data_ptr(), 0, c.data_ptr(), m, n, k, variant=v))
                      / 1e9 for v in hg.variants]  # fmt: skip
                var_lines.append(f"| {name} | {m} | " + " | ".join(f"{x:.0f}" for x in vt) + " |")
                print(var_lines[-1], flush=True)

        for name, n, k in SHAPES:
            a_all = (torch.randn(mmax, k, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
            w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
            c = torch.empty(mmax, n, device="cuda", dtype=torch.float32)
            for m in rows:
                measure(name, n, k, m, a_all[:m], w, c)
            del a_all, w, c
            torch.cuda.empty_cache()

        gpu = torch.cuda.get_device_name()
        drv = cuda.get_driver_version()
        machine = f"{gpu} (CUDA driver {drv}), {platform.node()}, torch {torch.__version__}"
        body = [
            f"TFLOP/s of 2 M N K, median of {args.reps} launches (CUDA events, L2 flushed before each), random bf16 "
            "operands; ours write fp32 C, cuBLAS (torch.matmul) bf16 C. The card's measured bf16 ceiling is "
            "~790 TFLOP/s (docs/PERFORMANCE.md, issue 16).",
            "",
            *table,
        ]
        if 2048 in rows:
            body += ["", f"The four products of a 2,048-token chunk over {LAYERS} layers: "
                     + ", ".join(f"{k} {v:.1f} ms" for k, v in chunk.items()) + "."]  # fmt: skip
        if args.variants:
            body += ["", "gemm_hopper by tile (BM x BN), TFLOP/s:", "", *var_lines]
        perfdoc.report(SECTION, machine=machine, command=perfdoc.command_line("python3"), body=body,
                       write=args.write)  # fmt: skip


def _ev(cuda, s):
    e = cuda.Event()
    e.record(s)
    return e


if __name__ == "__main__":
    main()
