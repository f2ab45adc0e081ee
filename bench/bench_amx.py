"""The cpu backend's weight products, AMX tiles against the avx2vnni build: cycles a pair.

Four products of the same matrix and rows: the amx build's tile product (what prefill chunks
take), its decode product with ``ig_amx_rows`` at ``--amx-rows`` (tiles from there on, AVX2
block sums below), the avx2vnni build's tiled (prefill) product, which has the same bits as
both, and its decode product (dot_group).

A pair is one (32-weight block, activation row); cycles are CPU time of one thread
(``time.process_time``) at a nominal 2.6 GHz, the minimum over interleaved repetitions
(amx, avx2vnni, amx, ...) in one process. Matrices: SmolLM2-135M's gate|up (1536 x 576,
Q4_1, in L2), down (576 x 1536, Q4_1) and lm_head (49152 x 576, Q8_0, 30 MB, streamed).

    .venv/bin/python bench/bench_amx.py [--rows 1,2,4,8,16] [--reps 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.cpu.build import load_kernels  # noqa: E402

GHZ = 2.6
MATRICES = {"gate_up 1536x576 Q4_1": (1536, 576, 3), "down 576x1536 Q4_1": (576, 1536, 3),
            "lm_head 49152x576 Q8_0": (49152, 576, 8)}  # fmt: skip


def _matrix(rows, cols, t, rng):
    from gguf.quants import quantize

    return quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)


def _setup(k, q, rows, cols, t, x):
    m = k.ffi.new("ig_mat *")
    m.type, m.rows, m.cols, m.row_bytes = t, rows, cols, q.shape[1]
    m.data = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(q))
    xq = k.ffi.new("ig_xblk[]", x.shape[0] * (cols // 32))
    k.lib.ig_quantize(k.ffi.cast("const float *", k.ffi.from_buffer(x)), x.shape[0], cols, xq)
    y = np.empty((x.shape[0], rows), np.float32)
    return m, xq, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--amx-rows", type=int, default=4)
    args = ap.parse_args()
    amx, vnni = load_kernels("amx"), load_kernels("avx2vnni")
    amx.lib.ig_amx_rows(args.amx_rows)
    rng = np.random.default_rng(0)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"threads {args.threads}, cycles a pair at {GHZ} GHz (min of {args.reps})")  # fmt: skip
    print("| matrix | rows | amx tiles | amx decode | avx2vnni tiled | avx2vnni decode | avx2vnni / amx decode |")
    print("|---|---|---|---|---|---|---|")
    for name, (rows, cols, t) in MATRICES.items():
        q = _matrix(rows, cols, t, rng)
        for nx in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((nx, cols)).astype(np.float32)
            runs = {}
            for label, k, fn in (("amx", amx, "ig_matmul_tiled"),
                ("amx decode", amx, "ig_matmul"), ("tiled", vnni, "ig_matmul_tiled"),
                                 ("decode", vnni, "ig_matmul")):  # fmt: skip
                m, xq, y = _setup(k, q, rows, cols, t, x)
                yp = k.ffi.cast("float *", k.ffi.from_buffer(y))
                runs[label] = (getattr(k.lib, fn), m, xq, y, yp, [])
            reps = args.reps if rows * nx < 200_000 else max(3, args.reps // 3)
            inner = max(1, 200_000 // (rows * nx))
            for _ in range(reps):
                for fn, m, xq, _y, yp, times in runs.values():
                    t0 = time.process_time()
                    for _ in range(inner):
                        fn(m, 1, xq, nx, yp, rows, args.threads)
                    times.append((time.process_time() - t0) / inner)
            assert np.array_equal(runs["amx"][3], runs["tiled"][3])
            assert np.array_equal(runs["amx decode"][3], runs["tiled"][3])
            pairs = rows * (cols // 32) * nx
            c = {label: min(r[5]) * GHZ * 1e9 / pairs for label, r in runs.items()}
            print(f"| {name} | {nx} | {c['amx']:.2f} | {c['amx decode']:.2f} | {c['tiled']:.2f} | {c['decode']:.2f} | "
                  f"{c['decode'] / c['amx decode']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
