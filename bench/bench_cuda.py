"""Benchmark of the CUDA backend on a Llama-3.1-8B-shaped model with random bf16 weights.

One run prints one table: measured read bandwidth and the weight-streaming bound of a
decode round; ignis decode round time at widths 1, 2, 4, 8 (tok/s per lane and
aggregate); prefill tok/s for 2,048- and 32,768-token prompts; and transformers
(eager attention, same weights, same GPU) for the same figures. With ``--write`` the
table replaces the "CUDA backend (H200)" section of docs/PERFORMANCE.md.

    python3 bench/bench_cuda.py --write
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
    ctx_blocks = -(-(DECODE_CONTEXT + rounds + 8) // 16)
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
    return res


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
        g = ig[("graph", w)]
        rows.append(f"| decode round, width {w} | {t * 1e3:.2f} ms ({1 / t:.1f} tok/s/lane, {w / t:.0f} agg; "
                    f"graph alone {g * 1e3:.2f} ms) | {hs} "
                    f"| {t / bound:.2f}x bound{vs_hf} |")  # fmt: skip
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
    ap.add_argument("--kernel-cache-dir", default="", help="compiled kernels (default: models/.cache/pycuda)")
    args = ap.parse_args()

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
    ig = bench_ignis(be, cfg, rng, args.prompts, args.rounds)
    breakdown = kernel_breakdown(be, bw)
    swept = []
    if args.sweep:
        settings = [("default (5 kernels a layer)", tuning),
                    ("4-step gemv_tc for every matrix (run 6's default)", replace(tuning, gemv_u2_below=0))]  # fmt: skip
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
        f"median of {args.rounds} rounds, wall time of decode_round (staging, graph replay, token read-back); "
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
