"""Where gemv_q.cu's time goes: its main loop's two halves timed apart (issue 14).

gemv_q.cu built with ``QPROBE`` 1 runs the stage pipeline alone (the bulk copies into shared memory
and the barriers, no decode), with ``QPROBE`` 2 the decode alone (no copies: it reads whatever the
slots hold); 0 is the kernel as the backend builds it. If the copies alone already take most of the
full kernel's time, the pipeline is the limit; if the decode alone does, the instructions and their
latencies are; if both are well under it, the two halves fail to overlap. Each case on the
Llama-3.1-8B shapes, width 1 and 8, at the committed tuning and at others (QU, QMINB, QNST[, QKH[,
QUF]]); ``--persist``: the grid of ``cuda.quant_persist`` (the blocks resident at once walk the
tiles); ``--carveout``: less shared memory preferred, more L1 (the activations' cache).

On the GPU machine, from the repo root:

    python3 bench/quant_probe.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_quant import SHAPES, device_name, timed  # noqa: E402

PROBES = {0: "full", 1: "copies only", 2: "decode only"}


def ncu_launches(cuda, stream, sets, pool, xb, out) -> None:
    """Each format's full kernel (committed tuning) twice on gate_up and down at width 1, then gemv_tc's
    bf16 kernel on the same shapes: plain launches, for ``ncu -k regex:gemv``."""
    from engine.cu.kernels import Kernels
    from engine.cu.quant import row_bytes

    for fmt, _tune, ks in sets:
        for name, n, k in SHAPES[2:]:
            w = cuda.to_device(np.resize(pool, n * row_bytes(fmt, k)))
            for _ in range(2):
                ks[0].gemv["store"](stream, ((n + 15) // 16,), x=int(xb), W=int(w), bias=0, out=int(out), M=1, N=n,
                                    K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0)  # fmt: skip
            stream.synchronize()
            print(f"launched {fmt} {name}", flush=True)
            w.free()
    kern = Kernels(128, 4)
    for name, n, k in SHAPES[2:]:
        w = cuda.to_device(np.resize(pool, 2 * n * k))
        for _ in range(2):
            kern.linear(stream, int(xb), int(w), 0, int(out), 1, n, k)
        stream.synchronize()
        print(f"launched bf16 {name}", flush=True)
        w.free()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="*", default=["Q4_K", "Q8_0", "Q6_K"])
    ap.add_argument("--tunings", nargs="*", default=["", "4,4,2", "4,2,4"],
                    help="QU,QMINB,QNST ('' = the committed one; Q8_0 takes QU 2 in place of 4)")  # fmt: skip
    ap.add_argument("--ncu", action="store_true",
                    help="launch each format's full kernel twice on gate_up and down, width 1, no graphs (to run "
                         "under ncu), and gemv_tc's bf16 kernel on the same shapes")  # fmt: skip
    ap.add_argument(
        "--persist",
        action="store_true",
        help="launch only the blocks resident at once, each walking tiles (Kernels' quant_persist)",
    )
    ap.add_argument(
        "--carveout",
        type=int,
        default=100,
        help="the GEMV's preferred shared-memory carveout, percent (the rest of the SM's 256 KB is L1)",
    )
    args = ap.parse_args()
    from bench.bench_cuda import read_bandwidth
    from engine.cu import runtime
    from engine.cu.kernels import TC_PARAMS
    from engine.cu.quant import QuantKernels, row_bytes

    with runtime.current():
        import pycuda.driver as cuda

        stream = cuda.Stream()
        bw = read_bandwidth(cuda, stream)
        print(f"{device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"python3 bench/quant_probe.py {' '.join(sys.argv[1:])}; read bandwidth {bw / 1e12:.2f} TB/s\n")  # fmt: skip
        print("| format | tuning | matrix | width | full µs (GB/s) | copies only µs | decode only µs |")
        print("|---|---|---|---|---|---|---|", flush=True)
        rng = np.random.default_rng(0)
        pool = np.frombuffer(rng.bytes(64 << 20), np.uint8)
        xb = cuda.to_device(np.full((8, 14336), 0x3F80, np.uint16))
        out = cuda.mem_alloc(8 * 28672 * 4)
        from engine.cu.launch import compiling

        sets = []
        with compiling():  # every variant's nvcc on a pool, then bound
            for fmt in args.formats:
                for tune_s in args.tunings:
                    tune = tuple(int(v) for v in tune_s.split(",")) if tune_s else None
                    if tune and fmt == "Q8_0":  # a 32-value format: QU 2 is its committed unit count
                        tune = (2, *tune[1:])
                    if args.ncu and tune:
                        continue
                    try:
                        sets.append(
                            (
                                fmt,
                                tune_s,
                                {
                                    p: QuantKernels(fmt, TC_PARAMS, tuning=tune, probe=p, carveout=args.carveout)
                                    for p in PROBES
                                },
                            )
                        )
                    except Exception as e:  # a tuning past the shared memory: say so, go on
                        print(f"| {fmt} | {tune_s} | - | - | {type(e).__name__}: {str(e)[:80]} | | |", flush=True)
        if args.ncu:
            ncu_launches(cuda, stream, sets, pool, xb, out)
            return
        for fmt, tune_s, ks in sets:
            for name, n, k in SHAPES[0:1] + SHAPES[2:]:
                nbytes = n * row_bytes(fmt, k)
                ws = [cuda.to_device(np.resize(pool, nbytes)) for _ in range(max(2, -(-128_000_000 // nbytes)))]
                for m in (1, 8):
                    cells = []
                    for p, q in ks.items():
                        t = timed(cuda, stream, lambda i, q=q, ws=ws, n=n, k=k, m=m: q.gemv["store"](
                            stream, q.grid(n, args.persist), x=int(xb), W=int(ws[i % len(ws)]), bias=0, out=int(out),
                            M=m, N=n, K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0))  # fmt: skip
                        cells.append(f"{t * 1e6:.1f}" + (f" ({nbytes / t / 1e9:,.0f})" if p == 0 else ""))
                    print(f"| {fmt} | {tune_s or 'default'} | {name} {n} x {k} | {m} | " + " | ".join(cells) + " |",
                          flush=True)  # fmt: skip
                for w in ws:
                    w.free()


if __name__ == "__main__":
    main()
