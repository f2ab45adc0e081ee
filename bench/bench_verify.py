"""What a verify round costs on the CUDA backend: a lane's k drafts as k more rows of the round.

Llama-3.1-8B shape, random bf16 weights (bench/bench_archs.py's builder), 512-token contexts: the
wall time of ``decode_round`` for ``lanes`` lanes each carrying k drafts (rows at consecutive
positions, as the scheduler plans them), against the plain round of the same lanes. The round
holds at most 8 rows (the decode graphs' widths). With ``--write`` the table replaces the
"Verify rounds (H200)" section of docs/PERFORMANCE.md.

    python3 bench/bench_verify.py --write
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

CASES = [(1, 0), (1, 1), (1, 3), (1, 4), (1, 7), (2, 0), (2, 3), (4, 0), (4, 1), (8, 0)]  # (lanes, drafts each)
CONTEXT = 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    import torch

    from bench.bench_archs import LLAMA_8B, make_weights
    from bench.perfdoc import command_line, report
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.backends.cuda import CudaBackend
    from engine.models import for_hf
    from engine.sampling import SamplingParams

    d = for_hf("llama")
    cfg = d.config_from_hf({"model_type": "llama", **LLAMA_8B})
    weights = make_weights(d, cfg, torch)
    be = CudaBackend()
    be.load(cfg, weights, block_size=16, kv_budget_bytes=4 << 30, host_kv_budget_bytes=0, max_context=2048)
    del weights
    torch.cuda.empty_cache()
    greedy = SampleRequest(params=SamplingParams(temperature=0.0), seed=1)
    rng = np.random.default_rng(0)
    tables = [list(range(i * 40, (i + 1) * 40)) for i in range(8)]
    for i, table in enumerate(tables):
        be.prefill(PrefillSpan(i, rng.integers(0, cfg.vocab_size, CONTEXT).tolist(), 0, table, sample=greedy),
                   StepOutput())  # fmt: skip
    times = {}
    for lanes, k in CASES:
        rows = [DecodeLane(i, int(rng.integers(0, cfg.vocab_size)), CONTEXT + j, tables[i], greedy)
                for i in range(lanes) for j in range(k + 1)]  # fmt: skip
        t = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            be.decode_round(rows, StepOutput())
            t.append(time.perf_counter() - t0)
        times[(lanes, k)] = statistics.median(t[3:])
    be.unload()
    lines = ["| lanes | drafts a lane | rows | round | vs the plain round of those lanes |", "|---|---|---|---|---|"]
    for lanes, k in CASES:
        ratio = f"{times[(lanes, k)] / times[(lanes, 0)]:.2f}x"
        lines.append(f"| {lanes} | {k} | {lanes * (k + 1)} | {times[(lanes, k)] * 1e3:.2f} ms | {ratio} |")
    body = [
        f"Llama-3.1-8B shape, random bf16 weights, {CONTEXT}-token contexts; wall time of decode_round, median of "
        f"{args.rounds}. A verify row reads the same weights as the round's other rows: the round costs its rows, "
        "not its drafts' count of weight streams.",
        "",
        *lines,
    ]
    report("## Verify rounds (H200)", machine=f"{torch.cuda.get_device_name(0)}, {platform.node()}",
           command=command_line("python3"), body=body, write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
