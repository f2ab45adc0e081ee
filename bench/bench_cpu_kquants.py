"""The cpu backend's K-quant and Q5 kernels: per-type product cost and a Q4_K_M model's decode rounds
kept as stored against the same file through the old Q8_0 conversion (docs/CPU.md, "K-quants as stored").

* Products: cycles a (32-weight block, activation row) pair of ``ig_matmul`` on one thread, a random
  [1536, 768] matrix of each type (in L2), at 1 and 8 rows; types interleaved, minimum over
  repetitions of the CPU time of a batch of calls, at a nominal 2.6 GHz.
* Rounds: one-thread CPU time of a decode round (forward and lm_head) at 1 and 8 lanes over
  256-token contexts; the file loaded twice (its Q5_0 / Q4_K / Q6_K kept, and re-quantized to Q8_0
  as before), rounds of both interleaved, medians; the weight bytes each streams a round; and a
  256-token prompt's prefill (the tiled kernels) on each.

    .venv/bin/python bench/bench_cpu_kquants.py /tmp/kq19/SmolLM2-135M-Instruct.Q4_K_M.gguf
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

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GHZ = 2.6


def products(reps: int) -> dict:
    from gguf import GGMLQuantizationType as T

    from engine.backends.cpu.build import load_kernels
    from tests.engine.test_cpu_kquants import random_blocks

    k = load_kernels()
    out_rows, cols = 1536, 768
    rng = np.random.default_rng(0)
    mats, keep = {}, []
    for fmt in TYPES:
        raw = random_blocks(fmt, out_rows, cols, gen=rng)
        m = k.ffi.new("ig_mat *")
        m.type, m.rows, m.cols, m.row_bytes = int(T[fmt]), out_rows, cols, raw.shape[1]
        m.data = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(raw))
        mats[fmt] = m
        keep.append(raw)
    x = rng.standard_normal((8, cols)).astype(np.float32)
    xq = k.ffi.new("ig_xblk[]", 8 * cols // 32)
    k.lib.ig_quantize(k.ffi.cast("const float *", k.ffi.from_buffer(x)), 8, cols, xq)
    y = np.empty((8, out_rows), np.float32)
    yp = k.ffi.cast("float *", k.ffi.from_buffer(y))
    best = {(f, r): float("inf") for f in TYPES for r in (1, 8)}
    calls = 20
    for _ in range(reps):
        for fmt in TYPES:
            for rows in (1, 8):
                c0 = time.process_time()
                for _ in range(calls):
                    k.lib.ig_matmul(mats[fmt], 1, xq, rows, yp, out_rows, 1)
                best[fmt, rows] = min(best[fmt, rows], (time.process_time() - c0) / calls)
    pairs = out_rows * cols // 32
    return {key: t * GHZ * 1e9 / (pairs * key[1]) for key, t in best.items()}


def load(path: Path, kept: frozenset):
    from engine.backends.cpu import CpuBackend
    from engine.loaders.gguf import load_gguf

    cfg, weights = load_gguf(path, as_stored=kept)
    backend = CpuBackend(threads=1)
    bb = 16 * cfg.kv_bytes_per_token_fp32
    backend.load(cfg, weights, block_size=16, kv_budget_bytes=160 * bb, host_kv_budget_bytes=0, max_context=2048)
    return cfg, backend


def rounds(path: Path, reps: int, prefills: int) -> dict:
    from engine.backend import DecodeLane, PrefillSpan, StepOutput
    from engine.backends.cpu import CpuBackend
    from tests.engine.test_hf_parity import GREEDY

    backends = {
        "as stored": load(path, CpuBackend.weights_as_stored),
        "Q8_0 conversion": load(path, frozenset({"Q8_0", "Q4_0", "Q4_1"})),
    }
    rng = np.random.default_rng(0)
    lanes = {}
    for name, (cfg, b) in backends.items():
        rng = np.random.default_rng(0)
        ls = []
        for i in range(8):
            table = list(range(20 * i, 20 * i + 20))
            ids = [int(t) for t in rng.integers(3, cfg.vocab_size, 256)]
            b.prefill(PrefillSpan(0, ids, 0, table), StepOutput())
            ls.append(DecodeLane(i, ids[-1], 256, table, GREEDY))
        lanes[name] = ls
    times = {(n, w): [] for n in backends for w in (1, 8, "prefill")}
    prompt = [int(t) for t in rng.integers(3, 1000, 256)]
    for rep in range(reps):
        for w in (1, 8):
            for name, (_, b) in backends.items():
                c0 = time.process_time()
                b.decode_logits(lanes[name][:w])
                times[name, w].append(time.process_time() - c0)
        if rep < prefills:  # a 256-token prompt on fresh pages, through the tiled kernels
            for name, (_, b) in backends.items():
                c0 = time.process_time()
                b.prefill(PrefillSpan(0, prompt, 0, list(range(140, 156))), StepOutput())
                times[name, "prefill"].append(time.process_time() - c0)
    out = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    out["bytes"] = {name: int(b.model.nbytes) for name, (_, b) in backends.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefills", type=int, default=5)
    a = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f} at start")
    cyc = products(a.reps)
    print("| type | cycles a pair, 1 row | 8 rows |\n|---|---|---|")
    for fmt in TYPES:
        print(f"| {fmt} | {cyc[fmt, 1]:.2f} | {cyc[fmt, 8]:.2f} |")
    r = rounds(a.gguf, a.reps, a.prefills)
    print("| weights | bytes a round | 1 lane, ms | 8 lanes, ms | 256-token prefill, ms |\n|---|---|---|---|---|")
    for name, nbytes in r["bytes"].items():
        print(f"| {name} | {nbytes / 1e6:.1f} MB | {r[name, 1]:.2f} | {r[name, 8]:.2f} | {r[name, 'prefill']:.0f} |")
    print(f"load {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
