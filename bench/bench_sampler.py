"""The host sampler's cost a row, on the default model's own logits, by parameter set.

Rows: the cpu backend's logits over random-token 256-token contexts (as bench_cpu.py's
decode rounds), made at the start, so the process's heap is in a served model's state
(freed buffers kept, no page faults for a row's temporaries). Each parameter set is timed
on every row; process CPU time, one thread, median and minimum of the rows. With
``--against-before`` the dense implementation the sampler replaced
(tests/engine/sampler_before.py, kept as the tests' oracle) runs on the same rows,
interleaved with it (the order alternating), and must draw the same tokens.

    .venv/bin/python bench/bench_sampler.py --against-before
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 1, top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "temperature 0.8, top-k 40": dict(temperature=0.8, top_k=40),
    "temperature 1, top-k 50, top-p 0.95": dict(temperature=1.0, top_k=50, top_p=0.95),
    "temperature 1, min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "temperature 0.7, top-p 0.9, repetition 1.1, frequency 0.5": dict(
        temperature=0.7, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.5
    ),
}


def model_rows(n: int) -> np.ndarray:
    """``n`` logits rows of the default GGUF through the cpu backend (one thread), random-token contexts."""
    from bench.bench_cpu import CONTEXT, load
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.sampling import SamplingParams

    backend = load("cpu", 1)
    rng = random.Random(0)
    vocab = backend.config.vocab_size
    sample = SampleRequest(SamplingParams(temperature=0.7, top_p=0.9), seed=1)
    rows, lane = [], 0
    while len(rows) < n:
        table = list(range(lane * 40, lane * 40 + 40))
        out = StepOutput()
        backend.prefill(PrefillSpan(0, [rng.randrange(100, vocab) for _ in range(CONTEXT)], 0, table, sample=sample),
                        out)  # fmt: skip
        token = out.prefill_token
        for pos in range(CONTEXT, CONTEXT + 15):
            logits = backend.decode_logits([DecodeLane(0, token, pos, table, sample)])
            rows.append(logits[0].copy())
            token = int(np.argmax(logits[0]))
        lane += 1
    return np.array(rows[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--against-before", action="store_true")
    args = ap.parse_args()
    from engine import sampler
    from engine.backend import SampleRequest
    from engine.sampling import SamplingParams

    impls = {"now": sampler}
    if args.against_before:
        from tests.engine import sampler_before

        impls = {"before": sampler_before, "now": sampler}
    rows = model_rows(args.rows)
    history = [int(t) for t in np.random.default_rng(0).integers(0, rows.shape[1], 300)]
    load = os.getloadavg()[0]
    print(f"{len(rows)} rows of {rows.shape[1]} logits; load average (1 min) {load:.1f} on {os.cpu_count()} cores")
    print("| parameters | " + " | ".join(f"{k} (median / min us a row)" for k in impls) + " |")
    print("|---|" + "---|" * len(impls))
    for name, params in CASES.items():
        req = SampleRequest(SamplingParams(**params), seed=3, prompt_token_ids=history[:200],
                            output_token_ids=history[200:])  # fmt: skip
        spent = {k: [] for k in impls}
        for i, row in enumerate(rows):
            order = list(impls) if i % 2 else list(impls)[::-1]
            tokens = set()
            for k in order:
                c = time.process_time()
                tokens.add(impls[k].sample_row(row, req, i)[0])
                spent[k].append(time.process_time() - c)
            if len(tokens) != 1:
                raise SystemExit(f"{name}: row {i} drew different tokens: {tokens}")
        cells = [f"{statistics.median(v) * 1e6:.0f} / {min(v) * 1e6:.0f}" for v in spent.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
