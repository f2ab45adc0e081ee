"""Where a CUDA decode round's time goes, kernel by kernel (issues 12, 15): the Llama-3.1-8B shape with
random bf16 weights (bench/bench_archs.py's builder), 512-token contexts, one decode graph replay per
case under torch's profiler (CUPTI records every kernel of the process, PyCUDA's and those inside a
graph), summed by kernel name; against the replay's own time between CUDA events, the rest being the
gaps between kernels. Cases: plain rounds of 1 and 8 lanes, verify rounds (lanes x rows a lane).

On the GPU machine, from the repo root:

    python3 bench/round_profile.py
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONTEXT = 512
CASES = [(1, 1), (8, 1), (1, 9), (8, 2), (8, 5), (8, 8)]  # (lanes, rows a lane)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="graph replays profiled per case (times are per replay)")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.bench_archs import llama_8b_on_cuda
    from bench.bench_cuda import graph_time
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.config import CudaTuning
    from engine.cu import runtime
    from engine.sampling import SamplingParams

    be, cfg, _ = llama_8b_on_cuda(torch, kv_budget_bytes=4 << 30, max_context=2048, tuning=CudaTuning(round_rows=64))
    greedy = SampleRequest(params=SamplingParams(temperature=0.0), seed=1)
    rng = np.random.default_rng(0)
    tables = [list(range(i * 40, (i + 1) * 40)) for i in range(8)]
    for i, table in enumerate(tables):
        be.prefill(PrefillSpan(i, rng.integers(0, cfg.vocab_size, CONTEXT).tolist(), 0, table, sample=greedy),
                   StepOutput())  # fmt: skip
    print(f"{torch.cuda.get_device_name(0)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"python3 bench/round_profile.py {' '.join(sys.argv[1:])}", flush=True)  # fmt: skip
    for lanes, per in CASES:
        rows = [DecodeLane(i, int(rng.integers(0, cfg.vocab_size)), CONTEXT + j, tables[i], greedy)
                for i in range(lanes) for j in range(per)]  # fmt: skip
        for _ in range(3):
            be.decode_round(rows, StepOutput())  # stages the inputs of this width's graph
        width = len(rows)
        graph = graph_time(be, width, 20)
        with runtime.current():
            import pycuda.driver as cuda

            cuda.Context.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    be.graphs.replay(width)
                cuda.Context.synchronize()
        by = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type.name != "CUDA":
                continue
            rec = by[ev.name]
            rec[0] += 1
            rec[1] += ev.time_range.end - ev.time_range.start  # µs
        total = sum(v[1] for v in by.values()) / args.reps  # µs a replay
        print(f"\n### {lanes} lane(s) x {per} row(s) = {width} rows: graph {graph * 1e6:.0f} µs, kernels "
              f"{total:.0f} µs, gaps {graph * 1e6 - total:.0f} µs ({(graph * 1e6 - total) / (graph * 1e6):.0%})\n")  # fmt: skip
        print("| kernel | launches a round | µs a round | share of the kernels |\n|---|---|---|---|")
        for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {n / args.reps:.0f} | {us / args.reps:.1f} | {us / args.reps / total:.1%} |")
        sys.stdout.flush()
    be.unload()


if __name__ == "__main__":
    main()
