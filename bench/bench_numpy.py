"""Benchmark of the numpy backend and the scheduler on the default model (SmolLM2-135M-Instruct).

One run prints one table (machine, command and date with it):

* decode rounds at 1, 2, 4 and 8 lanes (tok/s per lane and aggregate) and the
  8-lane round over the 1-lane round -- NumpyBackend.decode_round driven
  directly, widths interleaved so the shared machine's noise hits all alike;
* time to first token of a 1,000-token prompt cold and with its prefix
  retained -- Scheduler + NumpyBackend in-process, real clock;
* the decoding lanes' tok/s while a 2,000-token prompt prefills at decode share
  0, 25 and 50, against their unloaded rate measured just before and after --
  same in-process loop;
* memory: a real ``manage.py serve`` process (default model, 8 lanes, 2,048-token
  contexts) -- its peak RSS (VmHWM) and the KV pool's numpy nbytes against the
  memory plan the server logged.

    .venv/bin/python bench/bench_numpy.py --write

With ``--write`` the table replaces the "numpy backend" section of docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.messages import TokenEvent  # noqa: E402
from engine.sequence import SequenceStatus  # noqa: E402

SECTION = "## numpy backend"
WIDTHS = (1, 2, 4, 8)
DECODE_CONTEXT = 256  # prompt tokens per lane before the timed rounds
SAMPLING = {"temperature": 0.7, "top_p": 0.9}  # what a chat client typically sends
GiB = 1 << 30


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def median(xs) -> float:
    return statistics.median(xs)


# --- in-process: backend and scheduler ---------------------------------------------------


def load_backend(gguf: Path):
    from engine.backends.numpy import NumpyBackend
    from engine.config import EngineConfig
    from engine.loaders import load_artifact

    cfg = EngineConfig()  # the server's defaults: 16-token blocks, 768 MiB KV budget
    model_cfg, weights = load_artifact(gguf)
    backend = NumpyBackend()
    plan = backend.load(model_cfg, weights, block_size=cfg.block_size, kv_budget_bytes=cfg.kv_ram_budget,
                        host_kv_budget_bytes=cfg.host_kv_budget, max_context=cfg.max_context)  # fmt: skip
    del weights
    return backend, plan, cfg


def bench_widths(backend, rng: random.Random, reps: int) -> dict[int, float]:
    """Median seconds of one decode round per width; rounds of all widths interleaved."""
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.sampling import SamplingParams

    vocab, bs = backend.config.vocab_size, backend.block_size
    blocks = -(-(DECODE_CONTEXT + reps + 8) // bs)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(max(WIDTHS))]
    sample = SampleRequest(SamplingParams.from_dict(SAMPLING), seed=1)
    for table in tables:
        prompt = [rng.randrange(100, vocab) for _ in range(DECODE_CONTEXT)]
        backend.prefill(PrefillSpan(0, prompt, 0, table, sample=sample), StepOutput())
    times: dict[int, list[float]] = {n: [] for n in WIDTHS}
    for r in range(reps + 1):
        for n in WIDTHS:
            lanes = [DecodeLane(i, rng.randrange(100, vocab), DECODE_CONTEXT + r, tables[i], sample) for i in range(n)]
            t0 = time.perf_counter()
            backend.decode_round(lanes, StepOutput())
            if r:  # the first pass warms up
                times[n].append(time.perf_counter() - t0)
    return {n: median(ts) for n, ts in times.items()}


class Loop:
    """Scheduler + backend on a real clock: the worker's loop without the Channels layer."""

    def __init__(self, backend, plan, cfg):
        from engine.kv_manager import KVManager
        from engine.scheduler import Scheduler

        self.backend = backend
        self.sched = Scheduler(cfg, KVManager(plan.num_blocks, plan.block_size, plan.num_host_blocks))
        self.n = 0
        self.decoded: dict[str, int] = {}  # request id -> tokens streamed
        self.ttft: dict[str, float] = {}
        self.cached: dict[str, int] = {}

    def add(self, prompt: list[int], max_tokens: int, stop: bool = True) -> str:
        from engine.messages import AddRequest

        self.n += 1
        rid = f"bench-{self.n}"
        msg = AddRequest(rid, "bench", prompt, max_tokens, sampling=dict(SAMPLING),
                         stop_token_ids=list(self.backend.config.eos_token_ids) if stop else [])  # fmt: skip
        refused = self.sched.add_request(msg)
        assert refused is None, refused
        self.decoded[rid] = 0
        return rid

    def step(self) -> None:
        plan = self.sched.schedule()
        if plan.is_empty:
            time.sleep(0.001)
            return
        out = self.backend.step(plan)
        for event in self.sched.update_from_output(plan, out):
            if isinstance(event, TokenEvent):
                self.decoded[event.request_id] += len(event.token_ids)
                if event.ttft is not None:
                    self.ttft[event.request_id] = event.ttft
                    self.cached[event.request_id] = event.cached_tokens

    def run_until(self, done) -> None:
        while not done():
            self.step()

    def abort_all(self) -> None:
        self.sched.finish_requests(list(self.sched.seqs), SequenceStatus.FINISHED_ABORTED)


def bench_ttft(loop: Loop, rng: random.Random, reps: int) -> dict:
    """TTFT of fresh 1,000-token prompts, and of each again with its prefix retained."""
    vocab = loop.backend.config.vocab_size
    cold, warm, cached = [], [], []
    for _ in range(reps):
        prompt = [rng.randrange(100, vocab) for _ in range(1000)]
        for bucket in (cold, warm):
            rid = loop.add(prompt, max_tokens=1)
            loop.run_until(lambda rid=rid: rid not in loop.sched.seqs)
            bucket.append(loop.ttft[rid])
        cached.append(loop.cached[rid])
    return {"cold": median(cold), "retained": median(warm), "cached_tokens": median(cached)}


def lane_rate(loop: Loop, lane_ids: list[str], seconds: float) -> float:
    """Tokens per second per lane over a window with no prefill."""
    before, t0 = sum(loop.decoded[r] for r in lane_ids), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loop.step()
    return (sum(loop.decoded[r] for r in lane_ids) - before) / (time.perf_counter() - t0) / len(lane_ids)


def bench_share(loop: Loop, rng: random.Random, shares: list[float], lanes: int, window: float) -> dict:
    """The lanes' rate while a 2,000-token prompt prefills, per decode share."""
    vocab = loop.backend.config.vocab_size
    lane_ids = [loop.add([rng.randrange(100, vocab) for _ in range(64)], max_tokens=4000, stop=False)
                for _ in range(lanes)]  # fmt: skip
    loop.run_until(lambda: len(loop.sched.running) == lanes)
    out = {}
    for share in shares:
        loop.sched.cfg.decode_share = share
        unloaded = [lane_rate(loop, lane_ids, window)]
        before, t0 = sum(loop.decoded[r] for r in lane_ids), time.perf_counter()
        rid = loop.add([rng.randrange(100, vocab) for _ in range(2000)], max_tokens=1)
        loop.run_until(lambda rid=rid: rid in loop.ttft)
        elapsed = time.perf_counter() - t0
        during = (sum(loop.decoded[r] for r in lane_ids) - before) / elapsed / lanes
        loop.run_until(lambda rid=rid: rid not in loop.sched.seqs)
        unloaded.append(lane_rate(loop, lane_ids, window))
        base = sum(unloaded) / 2
        out[share] = {"during": during, "unloaded": base, "kept": during / base, "ttft": elapsed}
    loop.abort_all()
    return out


# --- the real server: memory --------------------------------------------------------------


def vm_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def bench_server_memory(lanes: int, context: int, new_tokens: int) -> dict:
    """Peak RSS of a real server serving ``lanes`` requests at ``context``-token contexts."""
    import httpx
    from openai import OpenAI

    from tests.e2e.server import start_server

    data = Path(tempfile.mkdtemp(prefix="ignis-bench-"))
    flags = ("--model-idle-unload", "0", "--spec-decode-lanes", str(lanes), "--model-max-context", str(context))
    proc, base = start_server(data, *flags)
    try:
        pid = proc.proc.pid
        after_load = vm_status(pid)
        words = "harbor lantern copper meadow quartz violin saddle ember thistle orbit canyon velvet".split()
        rng = random.Random(7)

        def prompt_of(n_words: int, i: int) -> list[dict]:
            text = f"Document {i}: " + " ".join(rng.choice(words) for _ in range(n_words))
            return [{"role": "user", "content": text}]

        target, n_words = context - new_tokens - 24, context - new_tokens
        for _ in range(3):  # fit the word count to the token target
            count = httpx.post(base + "/v1/tokenize", json={"messages": prompt_of(n_words, 0)}, timeout=60)
            n_words = max(1, int(n_words * target / count.json()["count"]))
        prompts = [prompt_of(n_words, i) for i in range(lanes)]
        counts = [httpx.post(base + "/v1/tokenize", json={"messages": p}, timeout=60).json()["count"] for p in prompts]
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1200)
        usages, peak_busy, rss_samples = [], 0, []

        def run(messages, max_tokens):
            r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                               max_tokens=max_tokens, temperature=0)  # fmt: skip
            usages.append(r.usage)

        threads = [threading.Thread(target=run, args=(p, max(1, context - c))) for p, c in zip(prompts, counts)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            stats = httpx.get(base + "/health", timeout=30).json()["engine"]["stats"]
            peak_busy = max(peak_busy, stats["lanes_busy"])
            rss_samples.append(vm_status(pid)["VmRSS"])
            time.sleep(0.5)
        for t in threads:
            t.join()
        engine = httpx.get(base + "/health", timeout=30).json()["engine"]
        final = vm_status(pid)
        logged = None
        for line in proc.log_text().splitlines():
            if "ignis.runtime.vram_plan" in line:
                logged = json.loads(line[line.index("{") :])
        return {
            "seconds": time.perf_counter() - t0,
            "rss_after_load": after_load["VmRSS"],
            "peak_rss": final["VmHWM"],
            "max_sampled_rss": max(rss_samples + [final["VmRSS"]]),
            "contexts": sorted(u.prompt_tokens + u.completion_tokens for u in usages),
            "peak_busy": peak_busy,
            "plan": engine["plan"],
            "logged_kv_bytes": (logged or {}).get("kv_bytes"),
        }
    finally:
        proc.stop()


# --- the table ------------------------------------------------------------------------------


NOTES = [
    "",
    "What the profile says (cProfile and per-call timers on the same machine):",
    "",
    "* One BLAS thread. With OpenBLAS's default 2 threads on this 2-core machine, the step thread's spinning "
    "workers compete with the event loop and with other processes; a decode round measured up to 14x slower "
    "than with 1 thread under load. The backend now limits BLAS to 1 thread unless OPENBLAS_NUM_THREADS / "
    "OMP_NUM_THREADS is set.",
    "* Top-p sampling sorted the whole vocabulary per row (an argsort of 49k, ~4-37 ms a row under load). It "
    "then sorted only the best 256 candidates, widened 8x while their mass fell short (2,000-3,000-token nuclei "
    "on these random prompts took two or three sorts, ~1.9 ms a row); now one histogram of the mass by distance "
    "below the best logit picks the cut, the candidates above it (a prefix of the stable order) are sorted once, "
    "and the draw runs over the nucleus only: ~0.6 ms a row, same tokens.",
    "* Decode products were OpenBLAS's packed GEMM at 2+ rows: it copies every weight panel before use, so 2 "
    "lanes cost 2.4x 1 lane. The weights now keep the checkpoint's [out, in] layout and a decode-width product "
    "is one stacked matmul over column blocks (views, no copy) sized for OpenBLAS's unpacked small-matrix "
    "kernel (M*N*K <= 1e6 and, for this operand order, M*N <= 1200: 64-144 columns at 8 rows). The layers' "
    "products at 8 rows now cost ~1.45x the 1-row GEMV (was ~3x), and the tied lm_head (49152 x 576) ~1.5x "
    "(12.7 against 31 ms at 8 rows). Only this orientation works: the same blocks of an [in, out] layout ran "
    "~2x slower at 8 rows. One row keeps the plain GEMV; prefill chunks past ~40 rows keep the packed GEMM.",
    "* What is left per lane is attention: each layer gathers every lane's K and V rows out of the paged pool "
    "(8 lanes x 257 slots x 768 B, twice) and that copy is memory-bound (~0.35 ms a layer at 8 lanes), ~19 ms "
    "of the 8-lane round at 256-token contexts and growing with context. Attending over contiguous runs of "
    "blocks in place (no gather) measured ~30% less per layer in a microbenchmark, but decode blocks come off "
    "the free list interleaved across lanes, so it would mostly help prompt blocks.",
    "* Memory: the peak is the steady state of 8 full contexts, not the load: the weights as float32 "
    "(0.54 GB) and the process (0.96 GB after load), the touched KV pages (8 x ~2,010 tokens x 46,080 B = "
    "0.74 GB), the rest prefill activations and heap. The margin under 2 GB is thin (1.95 GB); the tied "
    "lm_head used to be a second 113 MB copy of the embedding, which alone would have put it over. The "
    "column blocks are views of the one [out, in] array per weight, so blocking costs no memory.",
    "* Decode share: a prompt of two chunks used to wait only between its chunks, so at share 25 the lanes kept "
    "12% of their rate over its prefill; the scheduler now makes a prompt that takes the prefill lane while "
    "lanes decode wait its first chunk's share too.",
]


def fmt_table(widths, ttft, share, mem, kv_nbytes, plan) -> list[str]:
    rows = ["| figure | measured | target |", "|---|---|---|"]
    for n, sec in widths.items():
        rows.append(f"| decode round, {n} lane{'s' if n > 1 else ''} | {sec * 1e3:.1f} ms "
                    f"({1 / sec:.1f} tok/s per lane, {n / sec:.1f} aggregate) | |")  # fmt: skip
    ratio = widths[8] / widths[1]
    rows.append(f"| 8-lane round / 1-lane round | {ratio:.2f}x | <= 2x: {'met' if ratio <= 2 else 'MISSED'} |")
    rel = ttft["retained"] / ttft["cold"]
    rows.append(f"| TTFT, 1,000-token prompt, cold | {ttft['cold'] * 1e3:.0f} ms | |")
    rows.append(f"| TTFT, same prompt, prefix retained ({ttft['cached_tokens']:.0f} tokens cached) | "
                f"{ttft['retained'] * 1e3:.0f} ms ({rel:.1%} of cold) | < 20%: {'met' if rel < 0.2 else 'MISSED'} |")  # fmt: skip
    for s, r in share.items():
        target = ""
        if s == 0.25:
            target = f">= 20%: {'met' if r['kept'] >= 0.2 else 'MISSED'}"
        rows.append(f"| lanes while a 2,000-token prompt prefills, share {s:.0%} | {r['during']:.2f} tok/s per lane "
                    f"= {r['kept']:.0%} of {r['unloaded']:.2f} unloaded; the prompt's TTFT {r['ttft']:.1f} s "
                    f"| {target} |")  # fmt: skip
    if mem:
        peak = mem["peak_rss"] / GiB
        rows.append(f"| server peak RSS (VmHWM), {mem['peak_busy']} lanes at contexts "
                    f"{mem['contexts'][0]}-{mem['contexts'][-1]} tokens | {peak:.2f} GiB "
                    f"(after load {mem['rss_after_load'] / GiB:.2f} GiB) | < 2 GB: "
                    f"{'met' if mem['peak_rss'] < 2e9 else 'MISSED'} |")  # fmt: skip
        same = kv_nbytes == plan.kv_bytes == mem["plan"]["kv_bytes"] == mem["logged_kv_bytes"]
        rows.append(f"| KV pool: numpy nbytes / plan / server's plan / server's log | {kv_nbytes:,} / "
                    f"{plan.kv_bytes:,} / {mem['plan']['kv_bytes']:,} / {mem['logged_kv_bytes']:,} B "
                    f"({plan.num_blocks} blocks of {plan.block_size}) | equal: {'yes' if same else 'NO'} |")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="decode rounds per width")
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--share-lanes", type=int, default=7, help="lanes decoding beside the prefilling prompt")
    ap.add_argument("--window", type=float, default=4.0, help="seconds of each unloaded-rate window")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--write", action="store_true", help="update docs/PERFORMANCE.md")
    args = ap.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ignis_site.settings")
    from threadpoolctl import threadpool_info

    from apps.models.download import ensure_default_model
    from tests.conftest import models_dir

    gguf = ensure_default_model(models_dir())
    rng = random.Random(0)
    t0 = time.perf_counter()
    backend, plan, cfg = load_backend(gguf)
    load_s = time.perf_counter() - t0
    kv_nbytes = backend.k.nbytes + backend.v.nbytes
    blas = ", ".join(f"{i['internal_api']} {i['version']} {i['num_threads']} thread(s) {i.get('architecture', '')}"
                     for i in threadpool_info() if i["user_api"] == "blas")  # fmt: skip
    print(f"loaded in {load_s:.1f} s; {blas}", flush=True)
    widths = bench_widths(backend, rng, args.reps)
    print("widths", widths, flush=True)
    loop = Loop(backend, plan, cfg)
    ttft = bench_ttft(loop, rng, args.ttft_reps)
    print("ttft", ttft, flush=True)
    share = bench_share(loop, rng, [0.0, 0.25, 0.5], args.share_lanes, args.window)
    print("share", share, flush=True)
    backend.unload()
    del loop, backend
    mem = None if args.skip_server else bench_server_memory(lanes=8, context=2048, new_tokens=48)
    print("memory", mem, flush=True)

    import numpy as np

    from bench.perfdoc import command_line, report

    load = os.getloadavg()
    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, {platform.node()}, Python {platform.python_version()}, "
        f"numpy {np.__version__} ({blas}); load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(the machine is shared: figures are medians and ratios from this one run)"
    )
    body = [
        f"Model: {gguf.name} (dequantized to float32, {plan.weights_bytes / 1e6:.0f} MB of weights); "
        f"sampling {SAMPLING}. Decode rounds: NumpyBackend.decode_round at {DECODE_CONTEXT}-token contexts, "
        f"median of {args.reps} per width, widths interleaved. TTFT and decode share: Scheduler + NumpyBackend "
        f"in-process on the real clock (prefill chunk {cfg.prefill_chunk}; {args.share_lanes} lanes decode beside "
        f"the prompt; the window runs from its arrival to its first token; unloaded = mean of {args.window:.0f} s "
        "windows just before and after). Memory: `manage.py serve --spec-decode-lanes 8 --model-max-context 2048` "
        "(default 768 MiB KV budget), 8 concurrent chat requests filling their contexts, /proc/<pid>/status.",
        "",
        *fmt_table(widths, ttft, share, mem, kv_nbytes, plan),
        *NOTES,
    ]
    report(SECTION, machine=machine, command=command_line(".venv/bin/python"), body=body, write=args.write)


if __name__ == "__main__":
    main()
