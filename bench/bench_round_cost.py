"""The engine's own work between two decode rounds, piece by piece (issue 15, point 2).

Loads tests/models/tiny.py's random 2-layer llama (rounds of a few ms, as a GPU's) on the
cpu backend with one thread, decodes ``--lanes`` streams with the scheduler, and times in
one process, interleaved, each piece of a round's host work as the worker runs it: the
backend's step, ``update_from_output``, one ``to_message()`` per event, ``schedule()`` (a
synchronous round) or ``plan_ahead`` (a round planned ahead), and the hand-off of a step
to the step thread and back (``run_in_executor`` of a step that does nothing). Figures
are CPU time of this thread (``time.process_time``), medians over ``--rounds`` rounds.

    .venv/bin/python bench/bench_round_cost.py --lanes 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.backends.cpu import CpuBackend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv_manager import KVManager  # noqa: E402
from engine.loaders import load_artifact  # noqa: E402
from engine.messages import AddRequest  # noqa: E402
from engine.run_ahead import plan_ahead  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

GGUF = ROOT / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_backend(tmp: Path) -> CpuBackend:
    from tests.models.tiny import write_tiny_llama

    path = write_tiny_llama(tmp / "tiny-llama", GGUF)
    backend = CpuBackend(threads=1)
    cfg, weights = load_artifact(path, None, as_stored=True)
    backend.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
    return backend


def measure(backend: CpuBackend, lanes: int, rounds: int) -> dict[str, float]:
    cfg = EngineConfig(decode_lanes=8, prefill_chunk=256, max_context=2048, block_size=16, spec_enabled=False)
    sched = Scheduler(cfg, KVManager(backend.plan.num_blocks, 16, 0), seed_rng=random.Random(0),
                      max_round_rows=backend.max_round_rows)  # fmt: skip
    for i in range(lanes):
        prompt = [(i * 31 + j * 7) % 4000 + 10 for j in range(40)]
        add = AddRequest(f"r{i}", "c", prompt, rounds + 8, sampling={"temperature": 0, "ignore_eos": True})
        assert sched.add_request(add) is None
    while len(sched.running) < lanes:  # prefill every prompt first
        plan = sched.schedule()
        sched.update_from_output(plan, backend.step(plan))
    pool = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.new_event_loop()
    noop = lambda: None  # noqa: E731
    times: dict[str, list[float]] = {
        k: [] for k in ("step", "update", "to_message", "schedule", "plan_ahead", "handoff")
    }
    clock = time.process_time
    plan = sched.schedule()
    for _ in range(rounds):
        t0 = clock()
        out = backend.step(plan)
        t1 = clock()
        ahead = plan_ahead(sched, plan)  # planned (books taken) as the worker would, then undone by sync
        t2 = clock()
        outputs = sched.update_from_output(plan, out)
        t3 = clock()
        for o in outputs:
            o.to_message()
        t4 = clock()
        plan = sched.schedule()
        t5 = clock()
        loop.run_until_complete(loop.run_in_executor(pool, noop))
        t6 = clock()
        assert ahead is not None and [ln.position for ln in ahead.decode] == [ln.position for ln in plan.decode]
        for k, v in zip(times, (t1 - t0, t3 - t2, t4 - t3, t5 - t4, t2 - t1, t6 - t5)):
            times[k].append(v)
    pool.shutdown()
    loop.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        backend = tiny_backend(Path(tmp))
        print("| lanes | step | update_from_output | to_message (all) | schedule | plan_ahead | hand-off (no-op) |")
        print("|---|---|---|---|---|---|---|")
        for n in (int(x) for x in args.lanes.split(",")):
            m = measure(backend, n, args.rounds)
            print(f"| {n} | " + " | ".join(f"{m[k] * 1e6:.0f} us" for k in m) + " |")


if __name__ == "__main__":
    main()
