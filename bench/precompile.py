"""Fill PyCUDA's kernel cache in parallel before a GPU-machine run (nvcc is single-threaded; a test run
or bench_quant.py otherwise compiles its two dozen modules one after the other). Each job is a
process with its own context that builds ``Kernels`` for one (head_dim, group), or gemv_q.cu for
one format and tuning; later runs load the cached cubins.

    python3 bench/precompile.py [--quant-tunings Q4_K=4,2,2 ...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (head_dim, group) of the kernel tests, the tiny llamas, SmolLM2 and the 8B shape.
KERNEL_SHAPES = [(64, 2), (64, 3), (64, 4), (128, 4)]


def _job(job: tuple) -> str:
    t0 = time.perf_counter()
    from engine.cu import runtime

    with runtime.current():
        if job[0] == "kernels":
            from engine.cu.kernels import Kernels

            Kernels(job[1], job[2], gemv_pair=True)  # the backend's default: gemv_pair.cu too
        elif job[0] == "fp8_gemm":
            from engine.cu.hopper import HopperGemm

            HopperGemm(fp8=job[1])  # gemm_hopper.cu's fp8 builds (cuda.fp8_gemm)
        elif job[0] == "wide":
            from engine.cu.kernels import Kernels

            Kernels(job[1], job[2], wide_min_n=1)  # gemv_wide.cu besides (the rest is cached by then or twice)
        else:
            from engine.cu.kernels import TC_PARAMS
            from engine.cu.quant import QuantKernels

            QuantKernels(job[1], TC_PARAMS, tuning=job[2], act8=job[0] == "quant8")
    return f"{job} {time.perf_counter() - t0:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant-tunings", nargs="*", default=[], help="FMT=QU,QMINB,QNST")
    args = ap.parse_args()
    from engine.cu.quant import FP8_FORMATS, QUANT_FORMATS

    jobs: list[tuple] = [("kernels", d, g) for d, g in KERNEL_SHAPES]
    jobs += [("quant", f, None) for f in [*QUANT_FORMATS, *FP8_FORMATS]]
    jobs += [("quant8", f, None) for f in QUANT_FORMATS]  # cuda.quant_activations' int8-x GEMVs
    jobs.append(("wide", 128, 4))
    jobs += [("fp8_gemm", 1, None), ("fp8_gemm", 2, None)]  # hopper.PER_CHANNEL, hopper.BLOCK
    for spec in args.quant_tunings:
        f, t = spec.split("=")
        jobs.append(("quant", f, tuple(int(v) for v in t.split(","))))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(len(jobs), 16)) as pool:
        for line in pool.imap_unordered(_job, jobs):
            print(line, flush=True)
    print(f"precompiled {len(jobs)} jobs in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
