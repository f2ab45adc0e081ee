"""Short prompts on the CUDA backend: a burst of follow-up turns over a retained prefix, their
tails fed as rows of the decode round (``model.short_prefill``, the default 16) against a prefill
pass each (``short_prefill = 0``, what the engine did before).

Llama-3.1-8B shape, random bf16 weights (bench/bench_archs.py's builder), driven through the real
Scheduler: a 512-token prefix is prefilled once and retained; then N requests arrive together, each
the prefix plus its own TAIL-token turn, while ``busy`` other lanes decode. Reported: the time from
their arrival to each one's first token (median and last), over a few repeats. With ``--write``
the table replaces its section of docs/PERFORMANCE.md.

    python3 bench/bench_short.py --write
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "## Short prompts as decode rows (H200, issue 15 point 4)"
PREFIX, TAIL = 512, 12
CASES = [(1, 0), (4, 0), (7, 0), (4, 4)]  # (burst, lanes already decoding)


def burst_ttft(be, cfg, plan, short_prefill: int, burst: int, busy: int, rng) -> list[float]:
    """Seconds from a burst's arrival to each of its first tokens (through the scheduler)."""
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest, TokenEvent
    from engine.scheduler import Scheduler

    ecfg = EngineConfig(decode_lanes=8, prefill_chunk=2048, max_context=2048, block_size=16,
                        short_prefill=short_prefill, spec_enabled=False)  # fmt: skip
    sched = Scheduler(ecfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0),
                      max_round_rows=be.max_round_rows)  # fmt: skip
    prefix = rng.integers(0, cfg.vocab_size, PREFIX).tolist()

    def run(adds, until):
        for a in adds:
            assert sched.add_request(a) is None
        t0, got = time.perf_counter(), {}
        while not until(got):
            p = sched.schedule()
            for o in sched.update_from_output(p, be.step(p)):
                if isinstance(o, TokenEvent) and o.request_id not in got:
                    got[o.request_id] = time.perf_counter() - t0
        return got

    greedy = {"temperature": 0, "ignore_eos": True}
    run([AddRequest("warm", "c", prefix + [1], 1, sampling=greedy)], lambda g: not sched.has_work)  # retains it
    others = [AddRequest(f"busy{i}", "c", rng.integers(0, cfg.vocab_size, 64).tolist(), 10_000, sampling=greedy)
              for i in range(busy)]  # fmt: skip
    run(others, lambda g: len(g) == busy)
    adds = [AddRequest(f"b{i}", "c", prefix + rng.integers(0, cfg.vocab_size, TAIL).tolist(), 1, sampling=greedy)
            for i in range(burst)]  # fmt: skip
    got = run(adds, lambda g: all(a.request_id in g for a in adds))
    return [got[a.request_id] for a in adds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    import torch

    from bench.bench_archs import llama_8b_on_cuda
    from bench.perfdoc import command_line, report

    be, cfg, plan = llama_8b_on_cuda(torch, kv_budget_bytes=8 << 30, max_context=2048)
    rng = np.random.default_rng(0)
    burst_ttft(be, cfg, plan, 16, 2, 0, rng)  # warm-up: graphs, modules
    lines = ["| burst | lanes decoding | first token, prefill each (median / last) | as decode rows | last: speed-up |",
             "|---|---|---|---|---|"]  # fmt: skip
    for burst, busy in CASES:
        res = {}
        for sp in (0, 16):
            runs = [burst_ttft(be, cfg, plan, sp, burst, busy, rng) for _ in range(args.repeats)]
            res[sp] = (statistics.median(x for r in runs for x in r), statistics.median(max(r) for r in runs))
        lines.append(f"| {burst} | {busy} | {res[0][0] * 1e3:.1f} / {res[0][1] * 1e3:.1f} ms | "
                     f"{res[16][0] * 1e3:.1f} / {res[16][1] * 1e3:.1f} ms | {res[0][1] / res[16][1]:.2f}x |")  # fmt: skip
    be.unload()
    body = [
        f"Llama-3.1-8B shape, random bf16 weights; a {PREFIX}-token prefix retained, each request of the burst that "
        f"prefix plus {TAIL} tokens of its own, arriving together while other lanes decode; time from arrival to "
        f"each first token through the Scheduler, medians of {args.repeats} repeats. The round holds "
        f"{be.max_round_rows} rows on this backend: a burst's tails beyond them are fed over the next rounds.",
        "",
        *lines,
    ]
    report(SECTION, machine=f"{torch.cuda.get_device_name(0)}, {platform.node()}", command=command_line("python3"),
           body=body, write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
