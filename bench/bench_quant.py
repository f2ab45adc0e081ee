"""Benchmark of GGUF block formats on the CUDA backend (engine/cu/gemv_q.cu), on the GPU machine.

``--kernels``: every format's GEMV on the Llama-3.1-8B matrix shapes at widths 1 and 8 (µs and
achieved GB/s of the stored bytes, against the measured read bandwidth), and prefill's dequant of
the gate|up matrix against the 2,048-row GEMM it feeds.

``--synthetic Q4_K_M Q8_0``: the same for a Llama-3.1-8B-shaped model of random valid blocks built in
memory, with the types llama.cpp's quantizer gives each tensor (Q4_K_M: Q4_K, with Q6_K for the LM
head and for attn_v / ffn_down of the "more bits" layers; Q8_0: every matrix). ``--gguf NAME=PATH ...``:
each GGUF file loaded with its blocks as stored; the decode round (one
graph replay) at widths 1 and 8 after 512-token prompts, its bytes-streamed bound (the stored bytes
of every layer matrix and the LM head over the read bandwidth), and 2,048-token prefill. ``--bf16``
adds the bf16 path on random weights of the same shape (what an F16 file becomes). ``--act8``: every
GEMV and decode round also with ``cuda.quant_activations`` on (x quantized to int8 by quant_act.cu,
gemv_q.cu's QACT8 integer main loop; the kernel table's int8 columns include the quantizer's launch,
and a line gives the quantizer alone), the model's rounds after ``retune`` on the same load.

    python3 bench/bench_quant.py --kernels
    python3 bench/bench_quant.py --kernels --synthetic Q4_K_M Q8_0 --act8
    python3 bench/bench_quant.py --kernels --synthetic Q4_K_M Q8_0 --persist
    python3 bench/bench_quant.py --synthetic Q4_K_M Q8_0 --bf16
    python3 bench/bench_quant.py --gguf Q4_K_M=/tmp/peers/l8b-Q4_K_M.gguf Q8_0=/tmp/peers/l8b-Q8_0.gguf --bf16
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
# gemv_q.cu tunings timed beside the defaults (engine.cu.quant.QUANT_TUNING / DEFAULT_TUNING).
SWEEP = [("Q4_K", (4, 2, 3)), ("Q4_K", (4, 3, 2, 0)), ("Q4_K", (4, 4, 2)), ("Q6_K", (4, 2, 3)), ("Q8_0", (4, 2, 3)),
         ("Q8_0", (2, 3, 3))]  # fmt: skip
CONTEXT = 512


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.strip().splitlines()[0]  # fmt: skip
    except Exception:
        return "?"


def timed(cuda, stream, fn, reps: int = 5, calls: int = 10) -> float:
    """Seconds of one call on the stream: ``fn(i)`` for i < ``calls`` captured in one CUDA graph (so no
    host launch cost, ~10-20 µs a PyCUDA launch, sits between them), median of ``reps`` replays."""
    from engine.cu.runtime import Graph

    fn(0)
    g = Graph(stream, lambda: [fn(i) for i in range(calls)])
    times = []
    for _ in range(reps + 1):
        a, b = cuda.Event(), cuda.Event()
        a.record(stream)
        g.launch()
        b.record(stream)
        b.synchronize()
        times.append(b.time_since(a) / 1e3 / calls)
    g.destroy()
    return statistics.median(times[1:])


def bench_kernels(cuda, stream, bw: float, act8: bool = False, persist: bool = False) -> list[str]:
    from engine.cu.kernels import Kernels
    from engine.cu.quant import QUANT_FORMATS, Matrix, Part, quant_act_bytes, row_bytes

    rng = np.random.default_rng(0)
    lines = ["| format | matrix | N x K | MB | width 1 µs (GB/s) | width 8 µs (GB/s) |", "|---|---|---|---|---|---|"]
    if act8:
        lines = ["| format | matrix | N x K | MB | width 1 µs (GB/s) | width 8 µs (GB/s) | int8 x width 1 µs (GB/s) "
                 "| int8 x width 8 µs (GB/s) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    if persist:
        lines[0] += " persistent width 1 µs (GB/s) | persistent width 8 µs (GB/s) |"
        lines[1] += "---|---|"
    print("\n".join(lines), flush=True)
    kern = Kernels(128, 4, formats=list(QUANT_FORMATS), quant_act=act8)
    qbuf = None
    if act8:  # the int8 columns: x quantized each call (quant_act.cu) into this buffer, then the QACT8 GEMV
        qbuf = cuda.mem_alloc(quant_act_bytes(14336))
        kern.qact, kern.qact_bytes = int(qbuf), quant_act_bytes(14336)
    xb = cuda.to_device(np.full((8, 14336), 0x3F80, np.uint16))  # bf16 ones: any values time the same
    out = cuda.mem_alloc(8 * 28672 * 4)
    pool = np.frombuffer(rng.bytes(64 << 20), np.uint8)

    def copies(nbytes: int) -> list:
        """Copies of random bytes enough that consecutive calls never find their matrix in L2 (50 MB)."""
        return [cuda.to_device(np.resize(pool, nbytes)) for _ in range(max(2, -(-128_000_000 // nbytes)))]

    for fmt in QUANT_FORMATS:
        for name, n, k in SHAPES:
            nbytes = n * row_bytes(fmt, k)
            ws = copies(nbytes)
            mats = [Matrix((Part(int(w), fmt, n),), k) for w in ws]
            row = [f"| {fmt} | {name} | {n} x {k} | {nbytes / 1e6:.0f} |"]
            cases = [(False, 1, False), (False, 8, False)] + ([(True, 1, False), (True, 8, False)] if act8 else [])
            cases += [(False, 1, True), (False, 8, True)] if persist else []
            for q8, m, pers in cases:
                kern.quant_act, kern.quant_persist = q8, pers
                t = timed(cuda, stream, lambda i, m=m, n=n, k=k, mats=mats: kern.linear(
                    stream, int(xb), mats[i % len(mats)], 0, int(out), m, n, k))  # fmt: skip
                row.append(f" {t * 1e6:.1f} ({nbytes / t / 1e9:,.0f}) |")
            kern.quant_act, kern.quant_persist = act8, False
            lines.append("".join(row))
            print(lines[-1], flush=True)
            for w in ws:
                w.free()
    # Other tunings of gemv_q.cu (units a warp takes from a stage, blocks per SM, stages in flight), width 1.
    from engine.cu.kernels import TC_PARAMS
    from engine.cu.quant import QuantKernels

    lines.append("\n| format | QU, QMINB, QNST | gate_up µs (GB/s) | down µs (GB/s) |\n|---|---|---|---|")
    for fmt, tune in SWEEP:
        q = QuantKernels(fmt, TC_PARAMS, tuning=tune)
        row = [f"| {fmt} | {tune} (smem {q.smem}) |"]
        for _name, n, k in SHAPES[2:]:
            nbytes = n * row_bytes(fmt, k)
            ws = copies(nbytes)
            try:
                t = timed(cuda, stream, lambda i, q=q, ws=ws, n=n, k=k: q.gemv["store"](
                    stream, ((n + 15) // 16,), x=int(xb), W=int(ws[i % len(ws)]), bias=0, out=int(out), M=1, N=n,
                    K=k, ldo=n, ss_in=0, ss_nparts=0, eps=0.0, nw=0, xw=0, ss_out=0))  # fmt: skip
                row.append(f" {t * 1e6:.1f} ({nbytes / t / 1e9:,.0f}) |")
            except Exception as e:  # a tuning the device refuses: say so, time the others
                row.append(f" {type(e).__name__}: {e} |")
            for w in ws:
                w.free()
        lines.append("".join(row))
        print(lines[-1], flush=True)
    # Prefill: dequant of gate|up (Q4_K) into bf16 vs the GEMM of 2,048 rows over it.
    n, k, rows = 28672, 4096, 2048
    for fmt in ("Q4_K", "Q8_0"):
        w = cuda.to_device(np.resize(pool, n * row_bytes(fmt, k)))
        scratch = cuda.mem_alloc(2 * n * k)
        a = cuda.mem_alloc(2 * rows * k)
        c = cuda.mem_alloc(4 * rows * n)
        cuda.memset_d16(a, 0x3C00, rows * k)
        q, ws, ab, cb = kern.quant(fmt), int(w), int(scratch), int(c)
        tq = timed(cuda, stream, lambda i, q=q, ws=ws, ab=ab: q.dequantize(stream, ws, ab, n, k), calls=3)
        tg = timed(
            cuda, stream, lambda i, a=int(a), ab=ab, cb=cb: kern.linear(stream, a, ab, 0, cb, rows, n, k), calls=3
        )
        lines.append(f"\nprefill, {fmt} gate|up {n} x {k}: dequant to bf16 {tq * 1e6:.0f} µs, "
                     f"GEMM of {rows} rows {tg * 1e6:.0f} µs (dequant = {tq / tg:.0%} of the GEMM)")  # fmt: skip
        for buf in (w, scratch, a, c):
            buf.free()
    if act8:
        for m, k in ((1, 4096), (8, 4096), (8, 14336)):
            tq = timed(cuda, stream, lambda i, m=m, k=k: kern.quantize_act(stream, int(xb), m, k))
            lines.append(f"quant_act.cu alone, {m} x {k}: {tq * 1e6:.1f} µs")
        qbuf.free()
    lines.append(f"\nread bandwidth {bw / 1e12:.2f} TB/s")
    return lines


def bench_model(cuda, be, cfg, bw: float) -> dict:
    from bench.bench_cuda import graph_time
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.sampling import SamplingParams

    rng = np.random.default_rng(1)
    greedy = SampleRequest(params=SamplingParams(temperature=0.0), seed=1)
    res = {}
    per = -(-(CONTEXT + 64) // 16)
    ids = rng.integers(0, cfg.vocab_size, 2048).tolist()
    times = []
    for _ in range(3):
        out = StepOutput()
        t0 = time.perf_counter()
        be.prefill(PrefillSpan(seq_id=0, token_ids=ids, start_pos=0, block_table=list(range(130)), sample=greedy), out)
        times.append(time.perf_counter() - t0)
    res["prefill"] = min(times)
    lanes = []
    for i in range(8):
        table = list(range(200 + i * per, 200 + (i + 1) * per))
        out = StepOutput()
        be.prefill(PrefillSpan(seq_id=i, token_ids=rng.integers(0, cfg.vocab_size, CONTEXT).tolist(), start_pos=0,
                               block_table=table, sample=greedy), out)  # fmt: skip
        lanes.append(DecodeLane(seq_id=i, token_id=out.prefill_token, position=CONTEXT, block_table=table,
                                sample=greedy))  # fmt: skip
    for w in (1, 8):
        be.decode_round(lanes[:w], StepOutput())
        res[w] = graph_time(be, w)
    W = be.weights
    streamed = sum(m.nbytes for L in W.layers for m in (L.qkv, L.o, L.gate_up, L.down)) + W.lm_head.nbytes
    res["bytes"] = streamed
    res["bound"] = streamed / bw
    return res


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers) (Q4_K_M's Q6_K layers for attn_v and ffn_down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def synthetic(kind: str):
    """(cfg, weights) of the 8B shape: every matrix a QuantizedTensor of random valid blocks."""
    from engine.loaders.gguf import BLOCK_TYPES, QuantizedTensor
    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.hf_models import LLAMA3_ROPE, LLAMA8B

    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    cfg = ModelConfig(arch="llama", vocab_size=LLAMA8B["vocab_size"], hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      rope_theta=LLAMA3_ROPE["rope_theta"], rope_scaling=rope, max_position=131072,
                      tie_word_embeddings=False)  # fmt: skip
    rng = np.random.default_rng(0)
    pools = {}
    biggest = cfg.vocab_size * cfg.hidden_size  # the largest matrix's values

    def blocks(fmt: str, rows: int, k: int) -> QuantizedTensor:
        tid, qk, bb = BLOCK_TYPES[fmt]
        if fmt not in pools:  # random blocks with small finite fp16 scales; each matrix views a prefix
            b = np.frombuffer(rng.bytes(biggest // qk * bb), np.uint8).reshape(-1, bb).copy()
            for off in {"Q4_K": (0, 2), "Q6_K": (208,)}.get(fmt, (0,)):
                d = rng.integers(0x0400, 0x0A00, len(b), dtype=np.uint16)  # fp16 6e-5 .. 2e-4
                b[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
            pools[fmt] = b.reshape(-1)
        return QuantizedTensor(tid, (rows, k), pools[fmt][: rows * k // qk * bb].reshape(rows, -1))

    weights = {}
    for name, shape in definition("llama").tensors(cfg).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32)
            continue
        fmt = "Q8_0"
        if kind == "Q4_K_M":
            i = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            more = name == "lm_head.weight" or (("v_proj" in name or "down_proj" in name) and _more_bits(i, 32))
            fmt = "Q6_K" if more else "Q4_K"
        weights[name] = blocks(fmt, *shape)
    return cfg, weights


def row(name: str, r: dict) -> str:
    return (f"| {name} | {r['bytes'] / 2**30:.2f} GiB | {r['bound'] * 1e3:.2f} ms | {r[1] * 1e3:.2f} ms "
            f"({1 / r[1]:.0f} tok/s, {r[1] / r['bound']:.2f}x bound) | {r[8] * 1e3:.2f} ms ({8 / r[8]:,.0f} tok/s, "
            f"{r[8] / r[1]:.2f}x width 1) | {2048 / r['prefill']:,.0f} tok/s |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--gguf", nargs="*", default=[], help="NAME=PATH")
    ap.add_argument("--synthetic", nargs="*", default=[], choices=["Q4_K_M", "Q8_0"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--act8", action="store_true", help="also time cuda.quant_activations on (int8 x)")
    ap.add_argument("--persist", action="store_true", help="also time persistent quantized GEMVs (quant_persist)")
    args = ap.parse_args()
    from bench.bench_cuda import read_bandwidth
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        stream = cuda.Stream()
        bw = read_bandwidth(cuda, stream)
        print(f"{device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}; "
              f"python3 bench/bench_quant.py {' '.join(sys.argv[1:])}; read bandwidth {bw / 1e12:.2f} TB/s", flush=True)  # fmt: skip
        if args.kernels:
            print("\n".join(bench_kernels(cuda, stream, bw, args.act8, args.persist)), flush=True)
        rows = []
        header = ("| file | streamed | bound | width 1 round | width 8 round | prefill 2,048 |\n"
                  "|---|---|---|---|---|---|")  # fmt: skip
        from engine.backends.cuda import CudaBackend

        for spec in args.synthetic + args.gguf:
            t0 = time.perf_counter()
            if "=" in spec:
                from engine.loaders.gguf import load_gguf

                name, path = spec.split("=", 1)
                cfg, weights = load_gguf(path, as_stored=CudaBackend.weights_as_stored)
            else:
                name, (cfg, weights) = f"{spec} (random blocks)", synthetic(spec)
            be = CudaBackend()
            be.load(cfg, weights, block_size=16, kv_budget_bytes=4 << 30, host_kv_budget_bytes=0, max_context=4096)
            del weights
            load_s = time.perf_counter() - t0
            r = bench_model(cuda, be, cfg, bw)
            rows.append(row(f"{name} (load {load_s:.0f} s)", r))
            print(header + "\n" + rows[-1], flush=True)
            if args.act8:  # the same load, cuda.quant_activations on (graphs recaptured)
                from dataclasses import replace

                be.retune(replace(be.tuning, quant_activations=True))
                r = bench_model(cuda, be, cfg, bw)
                rows.append(row(f"{name}, int8 x (cuda.quant_activations)", r))
                print(header + "\n" + rows[-1], flush=True)
            if args.persist:  # the same load, persistent quantized GEMVs (graphs recaptured)
                from dataclasses import replace

                be.retune(replace(be.tuning, quant_activations=False, quant_persist=True))
                r = bench_model(cuda, be, cfg, bw)
                rows.append(row(f"{name}, persistent GEMVs (quant_persist)", r))
                print(header + "\n" + rows[-1], flush=True)
            be.unload()
        if args.bf16:
            from bench.bench_cuda import build_model
            from tests.kernels.test_cuda_model import load_cuda

            model, cfg = build_model(32)
            be, _ = load_cuda(model, cfg, as_numpy=False, kv=4 << 30)
            del model
            r = bench_model(cuda, be, cfg, bw)
            rows.append(row("bf16 (random, F16's shape)", r))
            be.unload()
        if rows:
            print("\n" + header + "\n" + "\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
