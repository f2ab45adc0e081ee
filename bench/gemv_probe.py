"""gemv_tc's K order timed both ways (issues 12, 15): warp w taking the strided steps w, w + 8, ..
(GEMV_KS 0, the backend's) or the contiguous run [w S8, (w + 1) S8) (GEMV_KS 1), on the Llama-3.1-8B
decode shapes, at the widths the round variants serve (1 and 8 on the 4-step and 2-step kernels; 16,
32 and 64 on _r16 / _r32 / _r64). A contiguous order would let a wide kernel that reads x once per
many weight rows walk K in address order and still give gemv_tc's bits.

On the GPU machine, from the repo root:

    python3 bench/gemv_probe.py
    ncu --section SpeedOfLight --section WarpStateStats -k regex:gemv_tc python3 bench/gemv_probe.py --ncu

``--ncu`` launches each round variant twice on gate_up, down and q,k,v (widths 8, 16, 64), untimed,
for a profiler to read where the wide variants' time goes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_quant import device_name, timed  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]  # fmt: skip
WIDTHS = [(1, ""), (1, "_u2"), (8, ""), (8, "_u2"), (16, "_r16"), (32, "_r32"), (64, "_r64")]


NCU_SHAPES, NCU_WIDTHS = ("gate_up", "down", "qkv"), ((8, ""), (16, "_r16"), (64, "_r64"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ncu", action="store_true", help="untimed launches for a profiler (see above)")
    args = ap.parse_args()
    from bench.bench_cuda import read_bandwidth
    from engine.cu import runtime
    from engine.cu.kernels import GEMV_ROW_TUNING, TC_PARAMS, TC_THREADS, WIDE_GROUPS, WIDE_STAGES, wide_smem
    from engine.cu.launch import Kernel, bound, compiling, module

    with runtime.current():
        import pycuda.driver as cuda

        stream = cuda.Stream()
        bw = read_bandwidth(cuda, stream)
        print(f"{device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; python3 bench/gemv_probe.py; "
              f"read bandwidth {bw / 1e12:.2f} TB/s\n")  # fmt: skip
        kern, wide = {}, {}
        with compiling():
            for ks in (0, 1):
                mod = module("gemv", (("TC_THREADS", TC_THREADS), *GEMV_ROW_TUNING, ("GEMV_KS", ks)))
                for _m, sfx in WIDTHS:
                    kern[(ks, sfx)] = Kernel(mod, f"gemv_tc_store{sfx}", TC_PARAMS["store"], TC_THREADS)
                wmod = module("gemv_wide", (("TC_THREADS", TC_THREADS), ("GEMV_EPILOGUES_ONLY", 1),
                                            ("TCW_NS", WIDE_STAGES), ("GEMV_KS", ks)), "", ("gemv",))  # fmt: skip
                for groups in WIDE_GROUPS:
                    wide[(ks, groups)] = Kernel(wmod, f"gemv_tcw_store_g{groups}", TC_PARAMS["store"], TC_THREADS,
                                                shared=wide_smem(groups))  # fmt: skip
        if args.ncu:
            ncu_launches(cuda, stream, {sfx: kern[(0, sfx)] for _m, sfx in NCU_WIDTHS})
            return
        for kw in wide.values():
            bound(kw.fn).set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, kw.shared)
        print(
            "| matrix | N x K | width | kernel | strided µs (TB/s) | contiguous µs (TB/s) | contiguous / strided "
            "| gemv_wide strided µs | gemv_wide contiguous µs | wide = tc bits (strided, contiguous) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
        rng = np.random.default_rng(0)
        xb = cuda.mem_alloc(64 * 14336 * 2)
        cuda.memcpy_htod(xb, ((rng.standard_normal((64, 14336)) * 0.1).astype(np.float32).view(np.uint32) >> 16)
                         .astype(np.uint16))  # fmt: skip
        out = cuda.mem_alloc(64 * 128256 * 4)
        pool = cuda.mem_alloc(64 << 20)
        cuda.memcpy_htod(pool, ((rng.standard_normal(32 << 20) * 0.02).astype(np.float32).view(np.uint32) >> 16)
                         .astype(np.uint16))  # fmt: skip
        for name, n, k in SHAPES:
            nbytes = 2 * n * k
            ws = []
            for _ in range(max(2, -(-160_000_000 // nbytes))):
                w = cuda.mem_alloc(nbytes)
                for off in range(0, nbytes, 64 << 20):  # random bf16 (their values do not change the time)
                    cuda.memcpy_dtod(int(w) + off, pool, min(64 << 20, nbytes - off))
                ws.append(w)
            for m, sfx in WIDTHS:
                cells = []
                for ks in (0, 1):
                    kk = kern[(ks, sfx)]
                    t = timed(cuda, stream, lambda i, kk=kk, n=n, k=k, m=m, ws=ws: kk(
                        stream, ((n + 15) // 16,), x=int(xb), W=int(ws[i % len(ws)]), bias=0, out=int(out), M=m, N=n,
                        K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0))  # fmt: skip
                    cells.append(t)
                extra = ""
                if m >= 16:  # gemv_wide at the same width, timed and compared bitwise with gemv_tc
                    groups = next(gr for gr in WIDE_GROUPS if m <= 8 * gr)
                    tw, same = [], []
                    for ks in (0, 1):
                        kw = wide[(ks, groups)]
                        tw.append(timed(cuda, stream, lambda i, kw=kw, n=n, k=k, m=m, ws=ws: kw(
                            stream, ((n + 127) // 128,), x=int(xb), W=int(ws[i % len(ws)]), bias=0, out=int(out), M=m,
                            N=n, K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0)))  # fmt: skip
                        res = []
                        for kk, grid in ((kern[(ks, sfx)], (n + 15) // 16), (kw, (n + 127) // 128)):
                            kk(stream, (grid,), x=int(xb), W=int(ws[0]), bias=0, out=int(out), M=m, N=n, K=k, ldo=n,
                               ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0)  # fmt: skip
                            host = np.empty((m, n), np.uint32)
                            cuda.memcpy_dtoh(host, out)
                            res.append(host)
                        same.append(bool(np.array_equal(res[0], res[1])))
                    extra = f" {tw[0] * 1e6:.1f} | {tw[1] * 1e6:.1f} | {same[0]}, {same[1]} |"
                print(f"| {name} | {n} x {k} | {m} | gemv_tc_store{sfx} | "
                      + " | ".join(f"{t * 1e6:.1f} ({nbytes / t / 1e12:.2f})" for t in cells)
                      + f" | {cells[1] / cells[0]:.3f} |" + (extra or " | | |"), flush=True)  # fmt: skip
            for w in ws:
                w.free()


def ncu_launches(cuda, stream, kern: dict) -> None:
    """Each of ``NCU_WIDTHS``' kernels twice on each of ``NCU_SHAPES`` (random bf16 x and W)."""
    rng = np.random.default_rng(0)
    xb = cuda.to_device(((rng.standard_normal((64, 14336)) * 0.1).astype(np.float32).view(np.uint32) >> 16)
                        .astype(np.uint16))  # fmt: skip
    out = cuda.mem_alloc(64 * 28672 * 4)
    for name, n, k in [sh for sh in SHAPES if sh[0] in NCU_SHAPES]:
        w = cuda.to_device(((rng.standard_normal(n * k).astype(np.float32) * 0.02).view(np.uint32) >> 16)
                           .astype(np.uint16))  # fmt: skip
        for m, sfx in NCU_WIDTHS:
            for _ in range(2):
                kern[sfx](stream, ((n + 15) // 16,), x=int(xb), W=int(w), bias=0, out=int(out), M=m, N=n, K=k, ldo=n,
                          ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0)  # fmt: skip
            stream.synchronize()
            print(f"launched gemv_tc_store{sfx} {name} x{m}", flush=True)
        w.free()


if __name__ == "__main__":
    main()
