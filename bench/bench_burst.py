"""A burst of prompts sent together: the time to each one's first token, prefilled in one step
(``model.prefill_group``, the default) against one prompt a step (what the engine did before).

The default GGUF on the cpu backend, driven through the real Scheduler on this thread: N distinct
prompts of LEN random tokens (no shared prefix) arrive at once, each asking for a few tokens, so
the first ones decode while the rest wait (one at a time: behind the decode-share gate). Reported
per mode: the first, median, last and mean request's time to first token, wall and CPU seconds of the
process (one kernel thread by default, so CPU time is the step's own), medians over the repeats,
the modes interleaved in each repeat. "single" is one such prompt alone. With ``--write`` the
table replaces its section of docs/PERFORMANCE.md.

    .venv/bin/python bench/bench_burst.py --repeats 5 --write
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "## Prompts prefilled together (issue 15)"
GGUF = ROOT / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def load(name: str, threads: int):
    from engine.backends.cpu import CpuBackend
    from engine.backends.numpy import NumpyBackend
    from engine.config import EngineConfig
    from engine.loaders import load_artifact

    cfg = EngineConfig()
    backend = CpuBackend(threads=threads) if name == "cpu" else NumpyBackend(blas_threads=threads)
    model_cfg, weights = load_artifact(GGUF, as_stored=name == "cpu")
    plan = backend.load(model_cfg, weights, block_size=cfg.block_size, kv_budget_bytes=256 << 20,
                        host_kv_budget_bytes=0, max_context=2048)  # fmt: skip
    return backend, model_cfg, plan


def burst(be, model_cfg, plan, n: int, length: int, group: bool, max_tokens: int, rng) -> list[tuple[float, float]]:
    """(wall, CPU) seconds from the burst's arrival to each request's first token, in arrival order."""
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest, TokenEvent
    from engine.scheduler import Scheduler
    from engine.sequence import SequenceStatus

    cfg = EngineConfig(decode_lanes=max(8, n), prefill_chunk=1024, max_context=2048, prefill_group=group)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, cfg.block_size, 0), seed_rng=random.Random(0),
                      max_round_rows=be.max_round_rows)  # fmt: skip
    greedy = {"temperature": 0, "ignore_eos": True}
    adds = [AddRequest(f"b{i}", "c", rng.integers(3, model_cfg.vocab_size, length).tolist(), max_tokens,
                       sampling=greedy) for i in range(n)]  # fmt: skip
    for a in adds:
        assert sched.add_request(a) is None
    wall0, cpu0, got = time.perf_counter(), time.process_time(), {}
    while len(got) < n:
        p = sched.schedule()
        if p.is_empty:  # only the gate holds the next prompt: the worker would wait for it
            time.sleep(sched.prefill_wait() or 0.0)
            continue
        for o in sched.update_from_output(p, be.step(p)):
            if isinstance(o, TokenEvent) and o.request_id not in got:
                got[o.request_id] = (time.perf_counter() - wall0, time.process_time() - cpu0)
    sched.finish_requests(list(sched.seqs), SequenceStatus.FINISHED_ABORTED)
    return [got[a.request_id] for a in adds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "numpy"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    from bench.perfdoc import command_line, report

    be, model_cfg, plan = load(args.backend, args.threads)
    rng = np.random.default_rng(0)
    n, length, mt = args.prompts, args.length, args.max_tokens
    burst(be, model_cfg, plan, 2, length, True, 2, rng)  # warm-up
    modes = {"single": (1, True), "together": (n, True), "one a step": (n, False)}
    runs: dict[str, list] = {m: [] for m in modes}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for mode, (k, group) in modes.items():
            runs[mode].append(burst(be, model_cfg, plan, k, length, group, mt, rng))
        loads.append(os.getloadavg()[0])

    def med(mode: str, pick, clock: int) -> float:
        return statistics.median(pick(sorted(t[clock] for t in r)) for r in runs[mode])

    lines = ["| mode | prompts | first token: first / median / last / mean, wall ms | CPU ms | last / single (wall, CPU) |",
             "|---|---|---|---|---|"]  # fmt: skip
    single = [med("single", lambda x: x[0], c) for c in (0, 1)]
    for mode, (k, _) in modes.items():
        cells = []
        for c in (0, 1):
            picks = (lambda x: x[0], lambda x: x[len(x) // 2], lambda x: x[-1], statistics.mean)
            vals = [med(mode, f, c) * 1e3 for f in picks]
            cells.append(" / ".join(f"{v:.0f}" for v in vals))
        last = [med(mode, lambda x: x[-1], c) / single[c] for c in (0, 1)]
        lines.append(f"| {mode} | {k} | {cells[0]} | {cells[1]} | {last[0]:.2f}x / {last[1]:.2f}x |")
    body = [
        f"The default GGUF (SmolLM2-135M Q4_1) on the {args.backend} backend, {args.threads} thread(s); {n} distinct "
        f"prompts of {length} random tokens arriving together, {mt} tokens each, through the Scheduler; medians of "
        f"{args.repeats} repeats, the modes interleaved; load average (1 min) {min(loads):.1f}-{max(loads):.1f}.",
        "",
        *lines,
    ]
    be.unload()
    report(SECTION, machine=f"{platform.processor() or platform.machine()}, {platform.node()}",
           command=command_line(".venv/bin/python"), body=body, write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
