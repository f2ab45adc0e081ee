"""The amx build's tile products from the copies made at load (``ig_amx_repack``) against unpacking
each strip at every product (the matrices without a copy) and, for the products, against the kernels
of another commit (``--base-src``: a directory holding that commit's kernels*.c / kernels.h).

Products: cycles a (32-block, activation row) pair of ``ig_matmul`` (decode: tiles from 3 rows),
one thread, CPU time, minimum over interleaved repetitions, at a nominal 2.6 GHz; every variant's
output is asserted bit-equal. Model: the default GGUF's decode round (forward, lm_head) at 1 and 8
lanes over 256-token contexts, CPU ms, medians, two amx backends in one process (with copies, and
with a budget of 0: no copies), interleaved.

    .venv/bin/python bench/bench_amx_repack.py [--base-src /tmp/main_src] [--reps 15] [--model-reps 15]
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

from engine.backends.cpu import build  # noqa: E402

GHZ = 2.6
MATRICES = {"lm_head 49152x576 Q8_0": (49152, 576, "Q8_0"), "gate_up 1536x576 Q4_1": (1536, 576, "Q4_1"), "down 576x1536 Q4_1": (576, 1536, "Q4_1"),
            "1536x768 Q4_0": (1536, 768, "Q4_0"), "1536x768 Q5_0": (1536, 768, "Q5_0"),
            "1536x768 Q4_K": (1536, 768, "Q4_K"), "1536x768 Q5_K": (1536, 768, "Q5_K")}  # fmt: skip


def _base(src: str):
    """The amx module of the kernels in ``src`` (built as build.py builds them)."""
    here = build.HERE
    build.HERE = Path(src)
    try:
        module = build._build("amx", build.default_cache_dir())
        assert module.lib.ig_amx_init() == 0
        return module
    finally:
        build.HERE = here


def _raw(fmt, rows, cols, rng):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from tests.engine.test_cpu_kquants import random_blocks

    if fmt in ("Q4_0", "Q4_1", "Q8_0"):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), T[fmt])
    return random_blocks(fmt, rows, cols, gen=rng)


def _setup(k, raw, t, rows, cols, x, repack, keep):
    m = k.ffi.new("ig_mat *")
    m.type, m.rows, m.cols, m.row_bytes = t, rows, cols, raw.shape[1]
    m.data = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(raw))
    if repack:
        size = k.lib.ig_amx_repack_bytes(m)
        buf = np.empty(size + 64, np.uint8)
        copy = buf[-buf.ctypes.data % 64 :][:size]
        k.lib.ig_amx_repack(m, k.ffi.cast("uint8_t *", k.ffi.from_buffer(copy)))
        m.tiles = k.ffi.cast("const uint8_t *", k.ffi.from_buffer(copy))
        keep.append(buf)
    xq = k.ffi.new("ig_xblk[]", x.shape[0] * (cols // 32))
    k.lib.ig_quantize(k.ffi.cast("const float *", k.ffi.from_buffer(x)), x.shape[0], cols, xq)
    y = np.empty((x.shape[0], rows), np.float32)
    return m, xq, y, k.ffi.cast("float *", k.ffi.from_buffer(y))


def products(args) -> None:
    from gguf import GGMLQuantizationType as T

    amx = build.load_kernels("amx")
    ks = {"copy": (amx, True), "no copy": (amx, False)}
    if args.base_src:
        ks["base"] = (_base(args.base_src), False)
    rng = np.random.default_rng(0)
    print("| matrix | rows | " + " | ".join(ks) + " |\n|---|---|" + "---|" * len(ks))
    for name, (rows, cols, fmt) in MATRICES.items():
        raw = _raw(fmt, rows, cols, rng)
        for nx in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((nx, cols)).astype(np.float32)
            keep, runs = [], {}
            for label, (k, rp) in ks.items():
                runs[label] = (k, *_setup(k, raw, int(T[fmt]), rows, cols, x, rp, keep), [])
            inner = max(1, 100_000 // (rows * nx))
            for _ in range(args.reps):
                for k, m, xq, _y, yp, times in runs.values():
                    t0 = time.process_time()
                    for _ in range(inner):
                        k.lib.ig_matmul(m, 1, xq, nx, yp, rows, 1)
                    times.append((time.process_time() - t0) / inner)
            assert np.array_equal(runs["copy"][3], runs["no copy"][3])
            if "base" in runs and fmt in ("Q4_0", "Q4_1", "Q8_0"):  # the base keeps the others on dot_group's bits
                assert np.array_equal(runs["copy"][3], runs["base"][3])
            pairs = rows * (cols // 32) * nx
            c = [min(r[5]) * GHZ * 1e9 / pairs for r in runs.values()]
            print(f"| {name} | {nx} | " + " | ".join(f"{v:.2f}" for v in c) + " |", flush=True)


def model(args) -> None:
    import importlib.util

    import engine.backends.cpu.backend as cpu_backend
    from engine.backend import DecodeLane, PrefillSpan, StepOutput
    from engine.backends.cpu import CpuBackend
    from engine.backends.cpu import model as cpu_model
    from engine.loaders import load_artifact
    from tests.engine.test_hf_parity import GREEDY

    cfg, weights = load_artifact(Path(args.gguf), as_stored=CpuBackend.weights_as_stored)
    b, real = {}, cpu_model.repack_budget
    variants = [("copy", real, None), ("no copy", lambda: 0, None)]
    if args.base_src:  # the other commit's kernels and model.py (its ig_mat has no copy)
        spec = importlib.util.spec_from_file_location(
            "engine.backends.cpu._base_model", Path(args.base_src) / "model.py"
        )
        base_model = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base_model)
        variants.append(("base", real, base_model))
    for label, budget, other in variants:
        cpu_model.repack_budget = budget
        be = CpuBackend(threads=1, isa="amx")
        if other:
            be.kernels = _base(args.base_src)
            cpu_backend.CpuModel = type("BaseModel", (other.CpuModel,), {"repacked_bytes": 0})
        be.load(cfg, weights, block_size=16, kv_budget_bytes=256 * 16 * cfg.kv_bytes_per_token_fp32,
                host_kv_budget_bytes=0, max_context=4096)  # fmt: skip
        cpu_backend.CpuModel = cpu_model.CpuModel
        b[label] = be
        print(
            f"# {label}: stored {be.model.nbytes / 1e6:.1f} MB, copies {getattr(be.model, 'repacked_bytes', 0) / 1e6:.1f} MB"
        )
    cpu_model.repack_budget = real
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size
    tables = [list(range(24 * i, 24 * (i + 1))) for i in range(8)]  # room for 128 rounds
    for be in b.values():
        for t in tables:
            be.prefill(PrefillSpan(0, [int(x) for x in rng.integers(100, vocab, 256)], 0, t), StepOutput())
    for n in (1, 2, 8):
        res = {k: ([], []) for k in b}
        for r in range(args.model_reps):
            for label, be in b.items():
                lanes = [DecodeLane(i, int(rng.integers(100, vocab)), 256 + r, tables[i], GREEDY) for i in range(n)]
                h = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
                c0 = time.process_time()
                be.decode_logits(lanes)
                c1 = time.process_time()
                be.model.logits(h)
                c2 = time.process_time()
                res[label][0].append((c1 - c0) - (c2 - c1)), res[label][1].append(c2 - c1)
        for label, (fw, lm) in res.items():
            print(f"decode {n} lanes, {label}: forward CPU ms median {1e3 * statistics.median(fw):.2f} "
                  f"min {1e3 * min(fw):.2f}, lm_head {1e3 * statistics.median(lm):.2f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8,16,64")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--model-reps", type=int, default=15)
    ap.add_argument("--base-src", default="")
    ap.add_argument("--gguf", default=str(ROOT / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--skip-products", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, one thread, "
          f"cycles a pair at {GHZ} GHz (min of {args.reps})")  # fmt: skip
    if not args.skip_products:
        products(args)
    if not args.skip_model:
        model(args)
    print(f"# end load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
