"""Decode attention alone (engine/cu/attention_decode.cu; issues 12 and 15): µs of one decode_attn call
by context and rows on the Llama-3.1-8B shape (8 KV heads of 4 query heads, head_dim 128, pages of 16
rows), for the backend's build and for builds with other compile-time switches (``--variant
NAME=DEFINE=VALUE[,DEFINE=VALUE]``). A case is 32 calls, one a layer of a 32-layer paged cache (so a
call's keys are not in L2 from the call before, as in a round), captured in one CUDA graph: the median
of 5 replays over 32. Every variant's output is compared with the backend build's: bitwise for the
switches that move loads, not arithmetic (DECODE_VPRE, DECODE_PIPE); a NUM_SPLITS variant (its grid
follows) merges in another order, so "differs" there is expected.

On the GPU machine, from the repo root:

    python3 bench/attn_probe.py --variant vpre0=DECODE_VPRE=0 pipe=DECODE_PIPE=1 s64=NUM_SPLITS=64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_quant import device_name, timed  # noqa: E402

D, G, KVH, BS, LAYERS = 128, 4, 8, 16, 32
CONTEXTS = [128, 512, 2048, 8192]
ROWS = [1, 8]
PARAMS = ("q:ptr positions:ptr block_tables:ptr bt_stride:i32 cache:ptr block_stride:i64 block_size:i32 KVH:i32 "
          "scale_log2:f32 o_part:ptr ml:ptr counters:ptr out:ptr window:i32 cap_log2:f32 sinks:ptr")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", nargs="*", default=[], help="NAME=DEFINE=VALUE[,DEFINE=VALUE]")
    args = ap.parse_args()
    from engine.cu import runtime
    from engine.cu.kernels import DECODE_SPLITS, DECODE_THREADS
    from engine.cu.launch import Kernel, compiling, module

    builds = [("backend", ())]
    for v in args.variant:
        name, _, rest = v.partition("=")
        builds.append((name, tuple((d, int(x)) for d, x in (p.split("=") for p in rest.split(",")))))
    with runtime.current():
        import pycuda.driver as cuda

        stream = cuda.Stream()
        base = {"HEAD_DIM": D, "GROUP": G, "NUM_SPLITS": DECODE_SPLITS, "DECODE_THREADS": DECODE_THREADS}
        # a variant's defines override the base's
        defines = {n: tuple({**base, **dict(defs)}.items()) for n, defs in builds}
        splits = {n: dict(d)["NUM_SPLITS"] for n, d in defines.items()}  # the grid's z and the partials' rows
        with compiling():
            kernels = {n: Kernel(module("attention_decode", defines[n]), "decode_attn", PARAMS, DECODE_THREADS)
                       for n, _ in builds}  # fmt: skip
        print(f"{device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"python3 bench/attn_probe.py {' '.join(sys.argv[1:])}\n", flush=True)  # fmt: skip
        pages = -(-max(CONTEXTS) // BS)
        rows_max = max(ROWS)
        page_bytes = 2 * BS * KVH * D * 2  # K and V of one layer's page
        block_stride = LAYERS * page_bytes // 2  # in bf16 elements, a page over every layer
        cache = cuda.mem_alloc(rows_max * pages * LAYERS * page_bytes)
        rng = np.random.default_rng(0)
        # values: a few distinct bf16 patterns, so the scores differ and the softmax is not flat
        pattern = (rng.standard_normal(1 << 20) * 0.5).astype(np.float32).view(np.uint32) >> 16
        chunk = cuda.to_device(pattern.astype(np.uint16))
        total = rows_max * pages * LAYERS * page_bytes
        for off in range(0, total, 2 << 20):
            cuda.memcpy_dtod(int(cache) + off, chunk, min(2 << 20, total - off))
        q = cuda.to_device((rng.standard_normal((rows_max, KVH * G, D)).astype(np.float32).view(np.uint32) >> 16)
                           .astype(np.uint16))  # fmt: skip
        tables = cuda.to_device(np.arange(rows_max * pages, dtype=np.int32).reshape(rows_max, pages))
        o_part = cuda.mem_alloc(rows_max * KVH * G * max(splits.values()) * D * 4)
        ml = cuda.mem_alloc(rows_max * KVH * G * max(splits.values()) * 2 * 4)
        counters = cuda.to_device(np.zeros(4096, np.int32))
        outs = {n: cuda.mem_alloc(rows_max * KVH * G * D * 2) for n, _ in builds}
        scale_log2 = float(D**-0.5 * 1.4426950408889634)
        print("| context | rows | " + " | ".join(f"{n} µs" for n, _ in builds) + " |")
        print("|---|---|" + "---|" * len(builds), flush=True)
        for ctx in CONTEXTS:
            for rows in ROWS:
                pos = cuda.to_device(np.full(rows, ctx - 1, np.int32))

                def call(k, layer, out, rows=rows, pos=pos, ns=DECODE_SPLITS):
                    k(stream, (KVH, rows, ns), q=int(q), positions=int(pos), block_tables=int(tables),
                      bt_stride=pages, cache=int(cache) + layer * page_bytes, block_stride=block_stride,
                      block_size=BS, KVH=KVH, scale_log2=scale_log2, o_part=int(o_part), ml=int(ml),
                      counters=int(counters), out=int(out), window=0, cap_log2=0.0, sinks=0)  # fmt: skip

                cells, ref = [], None
                for n, _ in builds:
                    k = kernels[n]
                    call(k, 0, outs[n], ns=splits[n])
                    stream.synchronize()
                    got = cuda.from_device(outs[n], (rows * KVH * G * D,), np.uint16)
                    if ref is None:
                        ref = got
                    same = np.array_equal(got, ref)
                    t = timed(cuda, stream, lambda i, k=k, n=n: call(k, i, outs[n], ns=splits[n]), reps=5, calls=LAYERS)
                    cells.append(f"{t * 1e6:.1f}" + ("" if same else " (output differs)"))
                print(f"| {ctx} | {rows} | " + " | ".join(cells) + " |", flush=True)
                pos.free()


if __name__ == "__main__":
    main()
