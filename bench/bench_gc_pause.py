"""Garbage-collector pauses in a serving process, with ``server.gc_freeze`` off and on.

Starts the real server on tests/models/tiny.py's 2-layer llama (bench/bench_serving.py's
``start_server``, the cpu backend) with bench/gc_probe on its PYTHONPATH, which times every
collection the process runs; after a warm-up, drives ``--bursts`` bursts of ``--streams`` streamed
chats released together (bench_serving's streams), then reads the pauses that fell in the measured
window: per generation, how many, their total and the longest, and the bursts' last first token
(client TTFT, median over the bursts). The modes alternate, ``--repeats`` times each. Run from the
repo root:

    .venv/bin/python bench/bench_gc_pause.py --write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_serving import GGUF, TINY, cpu_model, run_streams, start_server, stop_server  # noqa: E402
from bench.perfdoc import command_line, report  # noqa: E402

SECTION = "## Garbage-collector pauses while serving (issue 15)"


def probed(path: Path):
    """A server started inside the block runs bench/gc_probe, which writes its pauses to ``path``."""
    paths = (str(ROOT / "bench" / "gc_probe"), os.environ.get("PYTHONPATH"))
    return mock.patch.dict(
        os.environ, {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "IGNIS_GC_PROBE": str(path)}
    )


def pauses(path: Path, t0: float, t1: float) -> dict[int, list[float]]:
    """Generation -> the seconds of each pause the probe wrote that began in [t0, t1] (wall clock)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {g: [s for wall, gg, s in rows if gg == g and t0 <= wall <= t1] for g in (0, 1, 2)}


def summary(gens: dict[int, list[float]]) -> str:
    """``gen 0: count / total ms / longest ms; ...``"""
    return "; ".join(f"gen {g}: {len(v)} / {sum(v) * 1e3:.1f} / {max(v, default=0) * 1e3:.2f}" for g, v in gens.items())


def one_run(freeze: bool, args) -> dict:
    from tests.models.tiny import models_dir_with_two

    with tempfile.TemporaryDirectory(prefix="ignis-bench-gc-") as tmp:
        probe = Path(tmp) / "gc.jsonl"
        with probed(probe):
            models_dir = models_dir_with_two(Path(tmp) / "models", ROOT / "models" / GGUF)
            flags = ["--model-id", TINY, "--model-path", TINY, "--spec-enabled", "false",
                     "--server-gc-freeze", "true" if freeze else "false"]  # fmt: skip
            proc, log_path = start_server(ROOT, args.port, Path(tmp), flags, models_dir)
        base = f"http://127.0.0.1:{args.port}"
        try:
            run_streams(base, TINY, log_path, 1, 16)  # warm: lazy imports and caches
            run_streams(base, TINY, log_path, args.streams, args.tokens)
            t0 = time.time()
            bursts = [run_streams(base, TINY, log_path, args.streams, args.tokens) for _ in range(args.bursts)]
            seconds = time.time() - t0
            time.sleep(1.0)  # the probe writes every half second
        finally:
            stop_server(proc)
        gens = pauses(probe, t0, t0 + seconds)
    return {"freeze": freeze, "seconds": seconds, "gens": gens,
            "last_first_token": statistics.median(b["ttft_max"] for b in bursts)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bursts", type=int, default=10)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=18095)
    ap.add_argument("--write", action="store_true", help="replace this section of docs/PERFORMANCE.md")
    args = ap.parse_args()
    runs = [one_run(freeze, args) for _ in range(args.repeats) for freeze in (False, True)]

    def gen(g: list[float]) -> str:
        return f"{len(g)} / {sum(g) * 1e3:.1f} / {max(g, default=0) * 1e3:.2f}"

    body = [
        f"Model: tiny-llama (tests/models/tiny.py), cpu backend; {args.bursts} bursts of {args.streams} streamed chats "
        f"of {args.tokens} tokens released together, after a warm-up; pauses timed by bench/gc_probe in the measured "
        "window only (the freeze's own collections at start and after the load fall before it). One row a run, the "
        "modes alternated.",
        "",
        "| server.gc_freeze | window (s) | gen 0: count / total ms / longest ms | gen 1 | gen 2 | "
        "last first token of a burst, median (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        body.append(f"| {'on' if r['freeze'] else 'off'} | {r['seconds']:.1f} | {gen(r['gens'][0])} | "
                    f"{gen(r['gens'][1])} | {gen(r['gens'][2])} | {r['last_first_token'] * 1e3:.1f} |")  # fmt: skip
    machine = f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    report(SECTION, machine=machine, command=command_line(".venv/bin/python"), body=body, write=args.write)


if __name__ == "__main__":
    main()
