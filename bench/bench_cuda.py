"""Benchmark of the CUDA backend on a Llama-3.1-8B-shaped model with random bf16 weights.

One run prints one table: measured read bandwidth and the weight-streaming bound of a
decode round; ignis decode round time at widths 1, 2, 4, 8 (tok/s per lane and
aggregate); prefill tok/s for 2,048- and 32,768-token prompts; and transformers
(eager attention, same weights, same GPU) for the same figures. With ``--write`` the
table replaces the "CUDA backend (H200)" section of docs/PERFORMANCE.md.

``--prefill`` runs the prefill figures alone (issue 16) and owns the "Prefill on the CUDA
backend" section: prompts of 1,024 .. 32,768 tokens fed in chunks as the scheduler feeds them,
cold and after a retained prefix of half the prompt; the prefill attention kernel's own TFLOP/s
(useful work: the causal half of the products) on one 16K chunk, attention_prefill_hopper.cu
beside attention_prefill.cu; the four GEMMs of a chunk; and the chunk-size sweep that sets the
CUDA default (``--chunks``).

``--pdl`` only times the decode graphs (widths 1 and 8) with ``cuda.pdl`` off and on, twice in
turn on the same loaded model, and prints the rows (docs/CUDA.md, "Programmatic dependent launch").

    python3 bench/bench_cuda.py --write
    python3 bench/bench_cuda.py --prefill --write
    python3 bench/bench_cuda.py --pdl
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDTHS = (1, 2, 4, 8)
DECODE_CONTEXT = 512  # prompt tokens per lane before the timed decode rounds
SECTION = "## CUDA backend (H200)"
PREFILL_SECTION = "## Prefill on the CUDA backend (H200, Llama-3.1-8B shape, issue 16)"
PREFILL_PROMPTS = (1024, 2048, 8192, 32768)
# Measured beside ignis on an H200 (../shared/peers/README.md, 2026-12-01): transformers with its
# default sdpa attention (seconds by prompt length), and llama.cpp's pp2048 (F16, flash attention on).
TRANSFORMERS_SDPA = {2048: 0.0588}
LLAMA_CPP_PP2048 = 24.3e3  # tok/s

READ_KERNEL = r"""
extern "C" __global__ void read_sum(const uint4* __restrict__ p, size_t n, unsigned int* sink) {
    unsigned int acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
"""


def read_bandwidth(cuda, stream, nbytes=8 << 30, reps=10) -> float:
    """Bytes/s of a pure streaming read over a buffer far larger than L2."""
    from pycuda.compiler import SourceModule

    fn = SourceModule(READ_KERNEL, no_extern_c=True, arch="sm_90").get_function("read_sum")
    fn.prepare("PnP")
    buf, sink = cuda.mem_alloc(nbytes), cuda.mem_alloc(4)
    cuda.memset_d8(buf, 1, nbytes)
    sms = cuda.Context.get_device().get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
    grid = (sms * 8, 1, 1)
    times = []
    for _ in range(reps + 2):
        a, b = cuda.Event(), cuda.Event()
        a.record(stream)
        fn.prepared_async_call(grid, (256, 1, 1), stream, buf, np.uintp(nbytes // 16), sink)
        b.record(stream)
        b.synchronize()
        times.append(b.time_since(a) / 1e3)
    buf.free()
    return nbytes / statistics.median(times[2:])


def streamed_bytes(c) -> int:
    """Weight bytes a decode round must read (every layer matrix, norms and the LM head; not the embedding)."""
    d = c.head_dim
    per_layer = (c.num_heads + 2 * c.num_kv_heads) * d * c.hidden_size + c.hidden_size * c.num_heads * d
    per_layer += 3 * c.intermediate_size * c.hidden_size + 2 * c.hidden_size
    return 2 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size)


def build_model(layers: int):
    from tests.kernels.hf_models import LLAMA3_ROPE, LLAMA8B, random_model

    return random_model("llama", LLAMA3_ROPE, dtype="bfloat16", **dict(LLAMA8B, num_hidden_layers=layers))


def bench_ignis(be, cfg, rng, prompt_lens, rounds):
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.sampling import SamplingParams

    greedy = SampleRequest(params=SamplingParams(temperature=0.0), seed=1)
    res = {}
    blocks_per_seq = -(-(max(prompt_lens) + 64) // 16)
    for n in prompt_lens:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        times = []
        for _ in range(3 if n <= 4096 else 1):
            out = StepOutput()
            t0 = time.perf_counter()
            be.prefill(PrefillSpan(seq_id=0, token_ids=ids, start_pos=0, block_table=list(range(blocks_per_seq)),
                                   sample=greedy), out)  # fmt: skip
            times.append(time.perf_counter() - t0)
        res[("prefill", n)] = min(times)
    ctx_blocks = -(-(DECODE_CONTEXT + 2 * rounds + 8) // 16)  # the rounds, then as many planned ahead
    for w in WIDTHS:
        lanes = []
        for i in range(w):
            table = list(range(blocks_per_seq + i * ctx_blocks, blocks_per_seq + (i + 1) * ctx_blocks))
            out = StepOutput()
            be.prefill(PrefillSpan(seq_id=i, token_ids=rng.integers(0, cfg.vocab_size, DECODE_CONTEXT).tolist(),
                                   start_pos=0, block_table=table, sample=greedy), out)  # fmt: skip
            lanes.append(DecodeLane(seq_id=i, token_id=out.prefill_token, position=DECODE_CONTEXT,
                                    block_table=table, sample=greedy))  # fmt: skip
        times = []
        for _ in range(rounds):
            out = StepOutput()
            t0 = time.perf_counter()
            be.decode_round(lanes, out)
            times.append(time.perf_counter() - t0)
            for ln, t in zip(lanes, out.decode_tokens):
                ln.token_id, ln.position = t, ln.position + 1
        res[("decode", w)] = statistics.median(times[3:])
        res[("graph", w)] = graph_time(be, w)
        res[("ahead", w)] = ahead_time(be, lanes, rounds)
    return res


def ahead_time(be, lanes, rounds: int) -> float:
    """Wall time a round of rounds planned ahead, as the worker runs them (engine/run_ahead.py): each
    round's rows feed PENDING (the token drawn a round before, read on the device) and are queued with
    ``step(defer=True)`` before the round before is read back (``finish``)."""
    from engine.backend import PENDING, DecodeLane, StepPlan

    def plan(r: int) -> StepPlan:
        return StepPlan(decode=[DecodeLane(seq_id=ln.seq_id, token_id=ln.token_id if r == 0 else PENDING,
                                           position=ln.position + r, block_table=ln.block_table, sample=ln.sample)
                                for ln in lanes])  # fmt: skip

    be.finish(be.step(plan(0), defer=True))  # warm
    t0 = time.perf_counter()
    prev = be.step(plan(1), defer=True)
    for r in range(2, rounds + 1):
        cur = be.step(plan(r), defer=True)
        be.finish(prev)
        prev = cur
    be.finish(prev)
    return (time.perf_counter() - t0) / rounds


def graph_time(be, w: int, reps: int = 20) -> float:
    """Device time of one replay of the width-w decode graph (no host staging)."""
    import pycuda.driver as cuda

    from engine.cu import runtime

    with runtime.current():
        a, b = cuda.Event(), cuda.Event()
        be.graphs.replay(w)
        a.record(be.stream)
        for _ in range(reps):
            be.graphs.replay(w)
        b.record(be.stream)
        b.synchronize()
        return b.time_since(a) / 1e3 / reps


def kernel_breakdown(be, bw: float) -> list[str]:
    """Achieved read bandwidth of each decode GEMV shape on gemv_tc's 4-step and 2-step variants,
    widths 1 and 8 (kernel objects of their own: the backend's keep their settings). Each
    repetition reads another layer's matrix, so L2 never holds the weights."""
    import pycuda.driver as cuda

    from engine.cu import runtime
    from engine.cu.kernels import Kernels

    c, s, w, ws = be.config, be.stream, be.weights, be.ws
    hid, inter, hd = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    n_qkv = hd + 2 * c.num_kv_heads * c.head_dim
    shapes = [("q,k,v", "qkv", n_qkv, hid, ws.xn), ("o", "o", hid, hd, ws.attn),
              ("gate,up", "gate_up", 2 * inter, hid, ws.xn), ("down", "down", hid, inter, ws.act)]  # fmt: skip
    lines = ["| GEMV | N x K | width | tensor-core kernel (4 steps in flight; default from 40M weights) "
             "| tensor-core kernel (2 steps; default below 40M) |", "|---|---|---|---|---|"]  # fmt: skip
    with runtime.current():
        group = c.num_heads // c.num_kv_heads
        variants = [
            Kernels(c.head_dim, group, u2_below=u2, cache_dir=be.tuning.kernel_cache_dir) for u2 in (0, 1 << 62)
        ]
        for label, attr, n, kk, x in shapes + [("lm_head", None, c.vocab_size, hid, ws.xn)]:
            for m in (1, 8):
                cells = []
                for k in variants:
                    reps = 16
                    a, b = cuda.Event(), cuda.Event()
                    a.record(s)
                    for r in range(reps):
                        mat = w.lm_head if attr is None else getattr(w.layers[r % len(w.layers)], attr)
                        k.linear(s, x, mat, 0, ws.gu, m, n, kk)
                    b.record(s)
                    b.synchronize()
                    t = b.time_since(a) / 1e3 / reps
                    cells.append(f"{t * 1e6:.1f} us, {n * kk * 2 / t / 1e12:.2f} TB/s ({n * kk * 2 / t / bw:.0%})")
                lines.append(f"| {label} | {n} x {kk} | {m} | " + " | ".join(cells) + " |")
    return lines


def sweep(be, settings) -> list[str]:
    """Graph time at widths 1 and 8 under other kernel settings (``CudaBackend.retune`` recaptures)."""
    lines = ["| setting | graph w1 | graph w8 | w8 / w1 | nodes w1 |", "|---|---|---|---|---|"]
    saved = be.tuning
    for label, tuning in settings:
        try:
            be.retune(tuning)
            if be.kern.pdl != tuning.pdl:
                raise RuntimeError("CudaBackend._kernels() does not pass CudaTuning.pdl to Kernels")
            g1, g8 = graph_time(be, 1, 40), graph_time(be, 8, 40)
        except Exception as e:  # one setting failing must not lose the run's other figures
            lines.append(f"| {label} | failed: {type(e).__name__}: {e} | | | |")
            print(lines[-1], flush=True)
            continue
        nodes = be.graphs.num_nodes(1)
        lines.append(f"| {label} | {g1 * 1e3:.3f} ms | {g8 * 1e3:.3f} ms | {g8 / g1:.2f}x | {nodes} |")
        print(lines[-1], flush=True)
    be.retune(saved)
    return lines


def prefill_time(be, cfg, rng, n: int, chunk: int, prefix: int = 0, reps: int = 1) -> float:
    """Best wall time of prefilling tokens prefix..n of an n-token prompt in spans of ``chunk`` (the
    scheduler's steps, the last one sampling); the first ``prefix`` tokens are prefilled untimed first
    (a retained prefix)."""
    from engine.backend import PrefillSpan, SampleRequest, StepOutput
    from engine.sampling import SamplingParams

    greedy = SampleRequest(params=SamplingParams(temperature=0.0), seed=1)
    ids = rng.integers(0, cfg.vocab_size, n).tolist()
    table = list(range(-(-(n + 64) // 16)))

    def spans(a: int, b: int) -> None:
        for c0 in range(a, b, chunk):
            c1 = min(c0 + chunk, b)
            be.prefill(PrefillSpan(seq_id=0, token_ids=ids[c0:c1], start_pos=c0, block_table=table,
                                   sample=greedy if c1 == n else None), StepOutput())  # fmt: skip

    times = []
    for _ in range(reps):
        if prefix:
            spans(0, prefix)
        t0 = time.perf_counter()
        spans(prefix, n)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_rate(k, s, H: int, KVH: int, D: int, n: int = 16384, reps: int = 3) -> list[tuple[str, float, float]]:
    """(kernel, ms, useful TFLOP/s) of one n-position causal chunk with the model's heads (no prefix):
    useful work 4 * D * H * n (n + 1) / 2. attention_prefill_hopper.cu, then attention_prefill.cu
    (the Kernels object's Hopper route switched off for the second)."""
    import pycuda.driver as cuda

    from engine.cu import runtime

    bs = 16
    blocks = -(-n // bs)
    rng = np.random.default_rng(1)
    out = []
    with runtime.current():
        q = cuda.to_device((rng.standard_normal(n * H * D, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
        cache = cuda.to_device(
            (rng.standard_normal(blocks * 2 * bs * KVH * D, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        )
        table = cuda.to_device(rng.permutation(blocks).astype(np.int32))
        o = cuda.mem_alloc(n * H * D * 2)
        flops = 4 * D * H * n * (n + 1) / 2
        saved = k._prefill_hopper
        for label, route in (("attention_prefill_hopper (wgmma, TMA)", saved), ("attention_prefill (mma.sync)", None)):
            if label.startswith("attention_prefill_hopper") and route is None:
                continue
            k._prefill_hopper = route
            try:
                k.prefill_attention(s, q, table, cache, 2 * bs * KVH * D, bs, KVH, n, 0, o)
                a, b = cuda.Event(), cuda.Event()
                a.record(s)
                for _ in range(reps):
                    k.prefill_attention(s, q, table, cache, 2 * bs * KVH * D, bs, KVH, n, 0, o)
                b.record(s)
                b.synchronize()
            finally:
                k._prefill_hopper = saved
            t = b.time_since(a) / 1e3 / reps
            out.append((label, t * 1e3, flops / t / 1e12))
        for buf in (q, cache, table, o):
            buf.free()
    return out


def gemm_rates(be, m: int, reps: int = 10) -> list[tuple[str, int, int, float, float]]:
    """(matrix, N, K, ms, TFLOP/s) of each layer GEMM of an m-row chunk (Kernels.linear: gemm_hopper on sm_90)."""
    import pycuda.driver as cuda

    from engine.cu import runtime

    c, k, s, w, ws = be.config, be.kern, be.stream, be.weights, be.ws
    hid, inter, hd = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    n_qkv = hd + 2 * c.num_kv_heads * c.head_dim
    shapes = [("q,k,v", "qkv", n_qkv, hid, ws.xn), ("o", "o", hid, hd, ws.attn),
              ("gate,up", "gate_up", 2 * inter, hid, ws.xn), ("down", "down", hid, inter, ws.act)]  # fmt: skip
    out = []
    with runtime.current():
        for label, attr, n, kk, x in shapes:
            a, b = cuda.Event(), cuda.Event()
            a.record(s)
            for r in range(reps):
                k.linear(s, x, getattr(w.layers[r % len(w.layers)], attr), 0, ws.gu, m, n, kk)
            b.record(s)
            b.synchronize()
            t = b.time_since(a) / 1e3 / reps
            out.append((label, n, kk, t * 1e3, 2 * m * n * kk / t / 1e12))
        n = 2 * inter
        runs = (("gate,up + SwiGLU in the epilogue", lambda r: k.gate_up_act(s, ws.xn, w.layers[r].gate_up, ws.gu,
                                                                               ws.act, m, inter, hid)),
                ("gate,up, then swiglu", lambda r: (k.linear(s, ws.xn, w.layers[r].gate_up, 0, ws.gu, m, n, hid),
                                                    k.swiglu(s, ws.gu, ws.act, inter, m, interleaved=True))))  # fmt: skip
        for label, fn in runs:
            a, b = cuda.Event(), cuda.Event()
            a.record(s)
            for r in range(reps):
                fn(r % len(w.layers))
            b.record(s)
            b.synchronize()
            t = b.time_since(a) / 1e3 / reps
            out.append((label, n, hid, t * 1e3, 2 * m * n * hid / t / 1e12))
    return out


def cuda_default_chunk() -> int:
    """ignis_site/config.py's CUDA_PREFILL_CHUNK, read from the file (importing the package starts Celery)."""
    import re

    text = (ROOT / "ignis_site" / "config.py").read_text()
    return int(re.search(r"^CUDA_PREFILL_CHUNK = (\d+)", text, re.M).group(1))


def bench_prefill(args) -> None:
    """The ``--prefill`` run: its own section of docs/PERFORMANCE.md."""
    import torch

    from bench.perfdoc import command_line, report
    from engine.backends.cuda import CudaBackend, backend, forward
    from engine.config import CudaTuning

    torch.cuda.init()
    rng = np.random.default_rng(0)
    gpu = torch.cuda.get_device_name(0)
    chunks = sorted(set(args.chunks))
    default_chunk = cuda_default_chunk()
    rows = max(chunks + [forward.PREFILL_CHUNK])
    forward.PREFILL_CHUNK = backend.PREFILL_CHUNK = rows  # the workspace holds the largest chunk swept
    model, cfg = build_model(args.layers)
    be = CudaBackend(CudaTuning(kernel_cache_dir=args.kernel_cache_dir))
    prompts = args.prompts or list(PREFILL_PROMPTS)
    be.load(cfg, {n: p for n, p in model.state_dict().items()}, block_size=16, kv_budget_bytes=24 << 30,
            host_kv_budget_bytes=0, max_context=max(prompts) + 256)  # fmt: skip
    del model
    torch.cuda.empty_cache()
    prefill_time(be, cfg, rng, 4096, default_chunk)  # warm-up
    table = [f"| prompt | cold, chunks of {default_chunk:,} | after a retained prefix of half (the other half "
             "prefilled) | beside |", "|---|---|---|---|"]  # fmt: skip
    for n in prompts:
        reps = 3 if n <= 8192 else 1
        cold = prefill_time(be, cfg, rng, n, default_chunk, reps=reps)
        warm = prefill_time(be, cfg, rng, n, default_chunk, prefix=n // 2, reps=reps)
        peer = TRANSFORMERS_SDPA.get(n)
        beside = f"transformers sdpa {peer * 1e3:.1f} ms; llama.cpp {n / LLAMA_CPP_PP2048 * 1e3:.1f} ms" if peer else ""
        table.append(f"| {n:,} tokens | {cold * 1e3:.1f} ms ({n / cold:,.0f} tok/s) | {warm * 1e3:.1f} ms "
                     f"({(n - n // 2) / warm:,.0f} tok/s) | {beside} |")  # fmt: skip
        print(table[-1], flush=True)
    sweep_n = max(prompts)
    sweep = [f"| chunk | prefill {sweep_n:,} tokens | prefill 2,048 tokens |", "|---|---|---|"]
    for ch in chunks:
        t_long = prefill_time(be, cfg, rng, sweep_n, ch)
        t_short = prefill_time(be, cfg, rng, 2048, ch, reps=3)
        sweep.append(f"| {ch:,} | {t_long * 1e3:.0f} ms | {t_short * 1e3:.1f} ms |")
        print(sweep[-1], flush=True)
    attn = attention_rate(be.kern, be.stream, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    gemms = gemm_rates(be, default_chunk)
    be.unload()
    machine = f"{gpu}, {platform.node()}, Python {platform.python_version()}, torch {torch.__version__}"
    body = [
        f"Model: Llama-3.1-8B shape, {cfg.num_layers} layers, random bf16 weights, KV pages of 16 tokens. A prompt "
        f"goes to CudaBackend.prefill in spans of the CUDA default chunk ({default_chunk:,} tokens, "
        "ignis_site.config.CUDA_PREFILL_CHUNK), as the scheduler sends them, the last one sampling; wall time, median "
        "of 3 (1 at 32,768). Beside: transformers (sdpa) and llama.cpp measured on an H200 on 2026-12-01 "
        f"(../shared/peers/README.md): transformers 58.8 ms at 2,048 tokens; llama.cpp pp2048 F16 "
        f"{LLAMA_CPP_PP2048:,.0f} tok/s ({2048 / LLAMA_CPP_PP2048 * 1e3:.1f} ms).",
        "",
        *table,
        "",
        f"Prefill attention alone, one {16384:,}-position causal chunk, {cfg.num_heads} q heads on "
        f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim} (useful work: the causal half of the products; "
        "CUDA events, 3 calls):",
        "",
        "| kernel | time | useful TFLOP/s |",
        "|---|---|---|",
        *[f"| {label} | {ms:.2f} ms | {tf:.0f} |" for label, ms, tf in attn],
        "",
        f"The layer GEMMs of a {default_chunk:,}-row chunk (Kernels.linear, gemm_hopper; CUDA events, 10 calls "
        "over different layers):",
        "",
        "| matrix (N x K) | time | TFLOP/s |",
        "|---|---|---|",
        *[f"| {label} ({n} x {kk}) | {ms:.3f} ms | {tf:.0f} |" for label, n, kk, ms, tf in gemms],
        "",
        f"Chunk size (spans of that many tokens; workspace of {rows:,} rows for the sweep):",
        "",
        *sweep,
    ]
    report(PREFILL_SECTION, machine=machine, command=command_line("python3"), body=body, write=args.write)


def bench_hf(torch, model, cfg, rng, prompt_lens, rounds):
    res = {}

    def timed(fn, reps):
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return ts

    with torch.no_grad():
        for n in prompt_lens:
            ids = torch.tensor([rng.integers(0, cfg.vocab_size, n).tolist()], device="cuda")
            try:
                res[("prefill", n)] = min(timed(lambda ids=ids: model(ids, logits_to_keep=1), 2 if n <= 4096 else 1))
            except torch.OutOfMemoryError:
                res[("prefill", n)] = None
            torch.cuda.empty_cache()
        for w in WIDTHS:
            ids = torch.tensor(rng.integers(0, cfg.vocab_size, (w, DECODE_CONTEXT)).tolist(), device="cuda")
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            ts = []
            for _ in range(rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
                cache = out.past_key_values
            res[("decode", w)] = statistics.median(ts[3:])
            del cache, out
            torch.cuda.empty_cache()
    return res


def fmt_table(bw, bound, ig, hf, prompt_lens) -> list[str]:
    rows = ["| figure | ignis | transformers eager | ignis vs bound / vs transformers |", "|---|---|---|---|"]
    rows.append(f"| read bandwidth (measured) | {bw / 1e12:.2f} TB/s | | |")
    rows.append(f"| weight-streaming bound of a round | {bound * 1e3:.2f} ms | | |")
    for w in WIDTHS:
        t, h = ig[("decode", w)], hf.get(("decode", w))
        hs = f"{h * 1e3:.1f} ms ({1 / h:.1f} tok/s/lane, {w / h:.0f} agg)" if h else "n/a"
        vs_hf = f"; {h / t:.1f}x faster" if h else ""
        g, a = ig[("graph", w)], ig[("ahead", w)]
        rows.append(f"| decode round, width {w} | {t * 1e3:.2f} ms ({1 / t:.1f} tok/s/lane, {w / t:.0f} agg; "
                    f"graph alone {g * 1e3:.2f} ms) | {hs} "
                    f"| {t / bound:.2f}x bound{vs_hf} |")  # fmt: skip
        rows.append(f"| rounds planned ahead, width {w} | {a * 1e3:.2f} ms ({w / a:.0f} agg) | | "
                    f"{a / bound:.2f}x bound |")  # fmt: skip
    for n in prompt_lens:
        t, h = ig[("prefill", n)], hf.get(("prefill", n))
        hs = f"{h * 1e3:.0f} ms ({n / h:,.0f} tok/s)" if h else "OOM"
        ratio = f"{t / h:.2f}x transformers' time" if h else ""
        rows.append(f"| prefill {n:,} tokens | {t * 1e3:.0f} ms ({n / t:,.0f} tok/s) | {hs} | {ratio} |")
    r1, r8 = ig[("decode", 1)], ig[("decode", 8)]
    rows.append(f"| 8-lane round / 1-lane round | {r8 / r1:.2f}x | | target <= 1.3x |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prompts", type=int, nargs="*", default=[2048, 32768])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--write", action="store_true", help="update docs/PERFORMANCE.md")
    ap.add_argument("--sweep", action="store_true", help="also time the graphs under other GEMV settings")
    ap.add_argument("--pdl", action="store_true", help="only the decode graphs, cuda.pdl off and on")
    ap.add_argument("--kernel-cache-dir", default="", help="compiled kernels (default: models/.cache/pycuda)")
    ap.add_argument("--attention", action="store_true", help="the 16K prefill attention kernels alone")
    ap.add_argument("--prefill", action="store_true", help="the prefill figures alone (their own section)")
    ap.add_argument("--chunks", type=int, nargs="*", default=[1024, 2048, 4096, 8192], help="--prefill's sweep")
    args = ap.parse_args()
    if args.attention:  # the attention kernels alone on the 8B heads, no model (prints only)
        import pycuda.driver as cuda

        from engine.cu import runtime
        from engine.cu.hopper import FA_VARIANTS, HopperAttention
        from engine.cu.kernels import Kernels

        with runtime.current():
            k, s = Kernels(128, 4), cuda.Stream()
            for label, ms, tf in attention_rate(k, s, 32, 8, 128):
                print(f"| {label} | {ms:.2f} ms | {tf:.0f} TFLOP/s |", flush=True)
            saved = k._prefill_hopper
            for v in FA_VARIANTS:  # (P V width, stages, ping-pong)
                k._prefill_hopper = HopperAttention(4, variant=v)
                label, ms, tf = attention_rate(k, s, 32, 8, 128)[0]
                print(f"| variant {v} | {ms:.2f} ms | {tf:.0f} TFLOP/s |", flush=True)
            k._prefill_hopper = saved
        return
    if args.prefill:
        if args.prompts == [2048, 32768]:
            args.prompts = None
        bench_prefill(args)
        return

    import pycuda.driver as cuda
    import torch
    import transformers

    from bench.perfdoc import command_line, report
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.cu import runtime

    torch.cuda.init()
    rng = np.random.default_rng(0)
    gpu = torch.cuda.get_device_name(0)
    with runtime.current():
        bw = read_bandwidth(cuda, cuda.Stream())
    model, cfg = build_model(args.layers)
    bound = streamed_bytes(cfg) / bw
    tuning = CudaTuning(kernel_cache_dir=args.kernel_cache_dir)
    be = CudaBackend(tuning)
    t0 = time.perf_counter()
    max_ctx = max(args.prompts + [DECODE_CONTEXT]) + 256
    be.load(cfg, {n: p for n, p in model.state_dict().items()}, block_size=16, kv_budget_bytes=24 << 30,
            host_kv_budget_bytes=0, max_context=max_ctx)  # fmt: skip
    load_s = time.perf_counter() - t0
    if args.pdl:  # cuda.pdl off / on / off / on on the same loaded model, each recaptured (docs/CUDA.md)
        print(f"cuda.pdl: {cfg.num_layers} layers, load {load_s:.1f} s, bound {bound * 1e3:.2f} ms", flush=True)
        rows = sweep(be, [(f"cuda.pdl {'on' if on else 'off'}", replace(tuning, pdl=on)) for on in (False, True) * 2])
        print("\n".join(rows), flush=True)
        be.unload()
        return
    ig = bench_ignis(be, cfg, rng, args.prompts, args.rounds)
    breakdown = kernel_breakdown(be, bw)
    swept = []
    if args.sweep:
        settings = [("default (5 kernels a layer)", tuning),
                    ("4-step gemv_tc for every matrix (run 6's default)", replace(tuning, gemv_u2_below=0)),
                    ("programmatic dependent launch (cuda.pdl)", replace(tuning, pdl=True))]  # fmt: skip
        swept = ["", "Decode graph alone under other settings (re-captured):", "", *sweep(be, settings)]
    be.unload()
    hf = {} if args.skip_hf else bench_hf(torch, model, cfg, rng, args.prompts, args.rounds)

    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        drv = "?"
    machine = (f"{gpu} ({drv}), {platform.node()}, Python {platform.python_version()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}")  # fmt: skip
    body = [
        f"Model: Llama-3.1-8B shape, {cfg.num_layers} layers, random bf16 weights "
        f"({streamed_bytes(cfg) / 1e9:.2f} GB streamed per round); decode at {DECODE_CONTEXT}-token contexts, "
        f"median of {args.rounds} rounds, wall time of decode_round (staging, graph replay, token read-back; "
        f"planned ahead: the mean of {args.rounds} rounds queued one behind the other, each read back after "
        f"the next is queued); "
        f"ignis load {load_s:.1f} s (kernels compiled, graphs captured)",
        "",
        *fmt_table(bw, bound, ig, hf, args.prompts),
        "",
        "Decode GEMVs alone (CUDA events, 16 calls over different layers' weights):",
        "",
        *breakdown,
        *swept,
    ]
    report(SECTION, machine=machine, command=command_line("python3"), body=body, write=args.write)


if __name__ == "__main__":
    main()
