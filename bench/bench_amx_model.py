"""The amx build on the default GGUF against avx2vnni: the cold 1,000-token prompt and decode rounds.

Two cpu backends in one process (isa amx and avx2vnni), interleaved repetitions: a cold prompt
(one prefill span, fresh pages) in CPU time and wall time, and the decode round's forward and
lm_head at 1 and 8 lanes over 256-token contexts (CPU ms, the split of bench/bench_cpu.py),
the amx backend once with avx2vnni's decode path (ig_amx_rows 0) and once with decode products
through the tiles from ``--amx-rows`` rows on (3, the default) and AVX2 block sums below. Medians (and minimums) over ``--reps``.

    .venv/bin/python bench/bench_amx_model.py --threads 1 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GGUF = ROOT / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT = 256


def _load(isa: str, threads: int):
    from engine.backends.cpu import CpuBackend
    from engine.loaders import load_artifact

    backend = CpuBackend(threads=threads, isa=isa)
    cfg, weights = load_artifact(GGUF, as_stored=True)
    bs = 16
    backend.load(cfg, weights, block_size=bs, kv_budget_bytes=256 * bs * cfg.kv_bytes_per_token_fp32,
                 host_kv_budget_bytes=0, max_context=4096)  # fmt: skip
    return backend


def main() -> None:
    from engine.backend import DecodeLane, PrefillSpan, StepOutput
    from tests.engine.test_hf_parity import GREEDY

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--amx-rows", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--wall", action="store_true", help="decode in wall ms (for more than one thread), not CPU ms")
    ap.add_argument("--skip-prompt", action="store_true")
    ap.add_argument(
        "--twice", action="store_true", help="a second avx2vnni backend (how much the placement alone moves)"
    )
    args = ap.parse_args()
    b = {"amx": _load("amx", args.threads), "avx2vnni": _load("avx2vnni", args.threads)}
    if args.twice:
        b["avx2vnni again"] = _load("avx2vnni", args.threads)
    rng = np.random.default_rng(0)
    vocab = b["amx"].config.vocab_size
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"threads {args.threads}, reps {args.reps}")  # fmt: skip
    # cold prompt: pages 0..63 (1,000 tokens), fresh each time (the cache is overwritten)
    pt = {k: ([], []) for k in b}
    ids = [int(t) for t in rng.integers(100, vocab, args.prompt)]
    table = list(range(-(-args.prompt // 16)))
    for _ in range(0 if args.skip_prompt else args.reps):
        for name, be in b.items():
            w0, c0 = time.perf_counter(), time.process_time()
            be.prefill(PrefillSpan(0, ids, 0, table, want_logits=True), StepOutput())
            pt[name][0].append(time.perf_counter() - w0), pt[name][1].append(time.process_time() - c0)
    for name, (w, c) in pt.items() if not args.skip_prompt else ():
        print(f"prompt {args.prompt} {name}: CPU s median {statistics.median(c):.3f} min {min(c):.3f}, "
              f"wall s median {statistics.median(w):.3f} min {min(w):.3f}")  # fmt: skip
    # decode: 8 lanes of 256-token contexts at pages 64 + 17 i ...
    tables = [list(range(64 + 17 * i, 64 + 17 * (i + 1))) for i in range(8)]
    for be in b.values():
        for t in tables:
            be.prefill(PrefillSpan(0, [int(x) for x in rng.integers(100, vocab, CONTEXT)], 0, t), StepOutput())
    variants = [("avx2vnni", "avx2vnni", 0), ("amx, ig_amx_rows 0 (avx2vnni's decode)", "amx", 0),
                (f"amx, ig_amx_rows {args.amx_rows}", "amx", args.amx_rows)]  # fmt: skip
    if args.twice:
        variants.append(("avx2vnni again", "avx2vnni again", 0))
    for n in (1, 8):
        res = {v[0]: ([], []) for v in variants}
        for r in range(args.reps):
            for label, isa, rows in variants:
                be = b[isa]
                be.kernels.lib.ig_amx_rows(rows)
                lanes = [DecodeLane(i, int(rng.integers(100, vocab)), CONTEXT + r, tables[i], GREEDY) for i in range(n)]
                h = rng.standard_normal((n, be.config.hidden_size)).astype(np.float32)
                clock = time.perf_counter if args.wall else time.process_time
                c0 = clock()
                be.decode_logits(lanes)
                c1 = clock()
                be.model.logits(h)
                c2 = clock()
                res[label][0].append((c1 - c0) - (c2 - c1)), res[label][1].append(c2 - c1)
        for label, (fw, lm) in res.items():
            print(
                f"decode {n} lanes {label}: forward {'wall' if args.wall else 'CPU'} ms median {1e3 * statistics.median(fw):.2f} "
                f"min {1e3 * min(fw):.2f}, lm_head {1e3 * statistics.median(lm):.2f} min {1e3 * min(lm):.2f}"
            )


if __name__ == "__main__":
    main()
