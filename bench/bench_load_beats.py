"""Does the engine loop keep beating while a model loads on the step thread?

The worker's heartbeat (engine/worker.py) is sent from its event loop every second; the load
(engine/host.py ``_load_on_thread`` -> engine/loading.py ``load_model``) runs on the step
thread. Anything in the load that holds the GIL for long stops the loop, and a front end that
hears no beat for ``server.engine_timeout`` drops the engine. This runs the real load path on a
step thread while an asyncio ticker on the loop records the longest gap between its ticks (what
a heartbeat sees); a C watchdog (``faulthandler.dump_traceback_later``, re-armed at every tick,
so it fires only when the loop has been stalled ``--stall`` seconds) prints every thread's stack
then: the step thread's names what holds the GIL. The ticker goes on after the load until the
grammar tokenizer's warm thread (engine/constraint.py ``warm_in_background``) is done: the engine
beats through that too. ``--cold`` evicts the artifact's pages from the page cache first
(``posix_fadvise(DONTNEED)`` on its files only), as on a first load.

    python3 bench/bench_load_beats.py                        # default GGUF, numpy and cpu
    python3 bench/bench_load_beats.py --case bf16 [--vocab 49152] [--dir /tmp/ignis-beats-8b]
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GGUF = ROOT / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TICK = 0.01  # seconds between the ticker's wake-ups


@dataclass
class Gaps:
    """The loop's ticks while a load ran: the longest gap and the gaps over ``stall``."""

    seconds: float = 0.0  # the load's wall time
    longest: float = 0.0
    longest_after: float = 0.0  # after the load, while the grammar tokenizer warms
    ticks: int = 0
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (at, gap) past --stall


async def _ticker(gaps: Gaps, stop: asyncio.Event, stall: float, trace) -> None:
    t0 = last = time.perf_counter()
    while not stop.is_set():
        if trace is not None:
            faulthandler.dump_traceback_later(stall, file=trace)
        await asyncio.sleep(TICK)
        now = time.perf_counter()
        gap = now - last - TICK
        gaps.ticks += 1
        if gaps.seconds:
            gaps.longest_after = max(gaps.longest_after, gap)
        else:
            gaps.longest = max(gaps.longest, gap)
        if gap > stall:
            gaps.stalls.append((round(last - t0, 2), round(gap, 2)))
        last = now
    if trace is not None:
        faulthandler.cancel_dump_traceback_later()


async def loop_gaps(work, *, stall: float = 0.5, trace=None) -> tuple[Gaps, object]:
    """Run ``work()`` on a step thread while the loop ticks; its gaps (the longest is what a
    heartbeat sees) and what ``work`` returned, with stack dumps to ``trace`` (a file) of every
    stall over ``stall`` s."""
    gaps, stop = Gaps(), asyncio.Event()
    ticker = asyncio.create_task(_ticker(gaps, stop, stall, trace))
    await asyncio.sleep(TICK * 2)  # the ticker has started
    with ThreadPoolExecutor(1, thread_name_prefix="ignis-step") as step:
        t0 = time.perf_counter()
        try:
            result = await asyncio.get_running_loop().run_in_executor(step, work)
        finally:
            gaps.seconds = time.perf_counter() - t0
            while any(t.name == "ignis-grammar-warm" for t in threading.enumerate()):
                await asyncio.sleep(TICK)
            stop.set()
            await ticker
    return gaps, result


def evict(path: Path) -> None:
    """Drop ``path``'s pages (a file, or the files of a directory) from the page cache."""
    for p in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_once(path: Path, backend: str):
    """engine.loading.load_model as the model host calls it; the loaded backend."""
    from engine.config import EngineConfig
    from engine.loading import load_model

    cfg = EngineConfig(backend=backend, max_context=4096)
    be, _ = load_model(cfg, path, served_id="bench", max_context=4096, ram_budget=16 << 30,
                       progress=lambda done, total: None, on_context=lambda n: None)  # fmt: skip
    return be


def run_case(path: Path, backend: str, stall: float, trace, cold: bool = False) -> Gaps:
    if cold:
        evict(path)
    gaps, be = asyncio.run(loop_gaps(lambda: load_once(path, backend), stall=stall, trace=trace))
    be.unload()
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("gguf", "bf16"), default="gguf")
    ap.add_argument("--backend", action="append", help="numpy | cpu (default: both for gguf, numpy for bf16)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dir", default="", help="the bf16 checkpoint (written there once); default a temporary dir")
    ap.add_argument("--stall", type=float, default=0.5, help="gap in seconds that dumps the stacks")
    ap.add_argument("--trace", default="", help="file for the stack dumps (default stderr)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="evict the artifact from the page cache before each load")
    args = ap.parse_args()
    trace = open(args.trace, "w") if args.trace else sys.stderr  # noqa: SIM115 (open for the whole run)
    if args.case == "gguf":
        cases = [(GGUF, b) for b in args.backend or ("numpy", "cpu")]
        tmp = None
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_load import write_checkpoint

        tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="ignis-beats-")
        root = Path(args.dir or tmp.name)
        if not (root / "config.json").exists():
            t0 = time.perf_counter()
            n = write_checkpoint(root, args.layers, vocab=args.vocab)
            print(f"wrote {n / 1e9:.2f} GB of bf16 in {time.perf_counter() - t0:.1f} s to {root}", flush=True)
        cases = [(root, b) for b in args.backend or ("numpy",)]
    for path, backend in cases:
        for _ in range(args.repeat):
            g = run_case(path, backend, args.stall, trace, args.cold)
            print(f"{path.name} on {backend}{' (cold)' if args.cold else ''}: load {g.seconds:.2f} s, longest "
                  f"loop gap {g.longest:.3f} s ({g.longest_after:.3f} s after, while the grammar tokenizer "
                  f"warms), gaps over {args.stall} s (at, gap): {g.stalls}", flush=True)  # fmt: skip
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
