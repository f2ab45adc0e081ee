"""Benchmark of the cpu backend against the numpy backend and llama.cpp on the default GGUF.

One run prints one table (machine, load, command and date with it):

* decode rounds at 1, 2, 4 and 8 lanes over 256-token contexts (ms a round,
  tok/s per lane and in all), ``decode_round`` driven directly, widths and
  backends interleaved so the shared machine's noise hits all alike, two
  rounds a turn and the second timed (so a round follows its own backend's,
  as in a server and as llama.cpp's consecutive evals);
* cold prompts of 64 and 1,000 tokens (one prefill span each, fresh pages);
* where a cpu round goes at each width, timed inside ``decode_round`` itself
  (consecutive cpu rounds): the forward and the lm_head (the two C calls), the
  sampler, and the rest (the Python around them: staging, cffi), which add up
  to the round by construction;
* llama.cpp (llama-cpp-python, when ``--llamacpp-python`` names an interpreter
  that has it) on the same file with the same threads: one stream's decode
  after a 256-token prompt, ``Llama.eval`` of one token then ``Llama.sample``
  with its own sampler chain (temperature 0.7, top-p 0.9, as ours), so both
  sides' rounds include drawing the token (eval alone is printed too), and
  the same prompts, timed in a child process of this run.

    .venv/bin/python bench/bench_cpu.py --threads 2 --llamacpp-python /work/venv-llamacpp/bin/python --write

With ``--write`` the table replaces the "cpu backend" section of docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_numpy import cpu_model  # noqa: E402
from bench.perfdoc import command_line, report  # noqa: E402

SECTION = "## cpu backend"
GGUF = ROOT / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
WIDTHS = (1, 2, 4, 8)
CONTEXT = 256
PROMPTS = (64, 1000)

# use_extra_bufts off: ggml's AMX weight repack (on where the processor lists AMX) crashed in
# ggml_backend_amx_mul_mat on the KVM guest of 2026-12-01 for any batch of more than one token.
LLAMA_CPP = r"""
import json, sys, time, random
import llama_cpp.llama_cpp as C
_defaults = C.llama_model_default_params
def _params():
    p = _defaults(); p.use_extra_bufts = False; return p
C.llama_model_default_params = _params
from llama_cpp import Llama
path, threads, reps, context, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=1024, verbose=False)
rng = random.Random(0)
toks = lambda n: [rng.randrange(100, 49000) for _ in range(n)]
out = {"version": __import__("llama_cpp").__version__, "prompt": {}}
for n in map(int, prompts.split(",")):
    ts = []
    for _ in range(reps):
        llm.reset(); p = toks(n); t0 = time.perf_counter(); llm.eval(p); ts.append(time.perf_counter() - t0)
    out["prompt"][n] = sorted(ts)[len(ts) // 2]
llm.reset(); llm.eval(toks(context)); ts, tss = [], []
# its own sampler chain, built once (as a server keeps one): temperature 0.7, top-p 0.9, as ours below
llm._sampler = llm._init_sampler(top_k=0, top_p=0.9, min_p=0.0, temp=0.7)
for _ in range(8 * reps):
    t0 = time.perf_counter(); llm.eval(toks(1)); t1 = time.perf_counter(); llm.sample(); t2 = time.perf_counter()
    ts.append(t1 - t0); tss.append(t2 - t0)
out["decode"] = sorted(ts)[len(ts) // 2]
out["decode_sampled"] = sorted(tss)[len(tss) // 2]
print(json.dumps(out))
"""


def load(name: str, threads: int):
    from engine.backends.cpu import CpuBackend
    from engine.backends.numpy import NumpyBackend
    from engine.config import EngineConfig
    from engine.loaders import load_artifact

    cfg = EngineConfig()
    # numpy keeps its server default of one BLAS thread: OpenBLAS workers spinning between its
    # calls would take the cores from the cpu backend's threads in the interleaved rounds.
    backend = CpuBackend(threads=threads) if name == "cpu" else NumpyBackend(blas_threads=1)
    model_cfg, weights = load_artifact(GGUF, as_stored=name == "cpu")
    backend.load(model_cfg, weights, block_size=cfg.block_size, kv_budget_bytes=cfg.kv_ram_budget,
                 host_kv_budget_bytes=0, max_context=cfg.max_context)  # fmt: skip
    return backend


def bench(backends: dict, reps: int, rng: random.Random) -> dict:
    """Median seconds: decode rounds per (backend, width), cold prompts per (backend, length)."""
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.sampling import SamplingParams

    sample = SampleRequest(SamplingParams(temperature=0.7, top_p=0.9), seed=1)
    any_backend = next(iter(backends.values()))
    vocab, bs = any_backend.config.vocab_size, any_backend.block_size
    per = -(-(CONTEXT + reps + 8) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(max(WIDTHS))]
    prompts = [[rng.randrange(100, vocab) for _ in range(CONTEXT)] for _ in tables]
    for b in backends.values():
        for table, prompt in zip(tables, prompts):
            b.prefill(PrefillSpan(0, prompt, 0, table, sample=sample), StepOutput())
    times = {(name, n): [] for name in backends for n in WIDTHS}
    for r in range(reps + 1):
        for n in WIDTHS:
            for name, b in backends.items():
                # two rounds a turn, the second timed: a round right after another backend's finds the
                # caches holding that one's weights, while a server's rounds (and llama.cpp's evals
                # below) follow their own
                for timed in (False, True):
                    lanes = [DecodeLane(i, rng.randrange(100, vocab), CONTEXT + r, tables[i], sample)
                             for i in range(n)]  # fmt: skip
                    t0 = time.perf_counter()
                    b.decode_round(lanes, StepOutput())
                    if r and timed:
                        times[name, n].append(time.perf_counter() - t0)
    base = max(WIDTHS) * per
    for r in range(max(2, reps // 3) + 1):
        for n in PROMPTS:
            table = list(range(base, base + -(-n // bs)))
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            for name, b in backends.items():
                t0 = time.perf_counter()
                b.prefill(PrefillSpan(0, ids, 0, table, sample=sample), StepOutput())
                if r:
                    times.setdefault((name, f"p{n}"), []).append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


class _Timed:
    """Stands in for an object (the kernels' ``lib``, the sampler module) and adds up the wall and
    CPU seconds of the named calls made through it."""

    def __init__(self, inner, names: tuple[str, ...]):
        self._inner, self.spent = inner, {n: [0.0, 0.0] for n in names}

    def __getattr__(self, name: str):
        f = getattr(self._inner, name)
        if name not in self.spent:
            return f

        def timed(*args):
            w, c = time.perf_counter(), time.process_time()
            try:
                return f(*args)
            finally:
                self.spent[name][0] += time.perf_counter() - w
                self.spent[name][1] += time.process_time() - c

        return timed


def split(backend, reps: int, rng: random.Random) -> dict:
    """Where a cpu decode round goes, per width: ``decode_round`` timed whole, and inside it the
    forward (every layer, one C call), the lm_head (the second C call), the sampler and the rest
    (staging arrays, cffi, the Python between), the rest being the round less the other three;
    median wall ms and median process CPU ms of each (medians of parts need not add up exactly).

    Run after ``bench`` on the same lanes and positions (their K/V rewritten, the contexts as long),
    cpu rounds only, back to back as a server's."""
    from engine.backend import DecodeLane, SampleRequest, StepOutput
    from engine.backends.cpu import backend as cpu_backend
    from engine.sampling import SamplingParams

    sample = SampleRequest(SamplingParams(temperature=0.7, top_p=0.9), seed=1)
    vocab, bs = backend.config.vocab_size, backend.block_size
    per = -(-(CONTEXT + reps + 8) // bs)
    model, lib, sampler = backend.model, backend.model.lib, cpu_backend.sampler
    model.lib = kernels = _Timed(lib, ("ig_forward", "ig_logits"))
    cpu_backend.sampler = drawn = _Timed(sampler, ("sample_rows",))
    out = {}
    try:
        for n in WIDTHS:
            parts = {k: [] for k in ("round", "forward", "lm_head", "sampling", "rest")}
            for r in range(reps + 1):
                lanes = [DecodeLane(i, rng.randrange(100, vocab), CONTEXT + r, list(range(i * per, (i + 1) * per)),
                                    sample) for i in range(n)]  # fmt: skip
                for acc in (*kernels.spent.values(), *drawn.spent.values()):
                    acc[:] = [0.0, 0.0]
                w0, c0 = time.perf_counter(), time.process_time()
                backend.decode_round(lanes, StepOutput())
                whole = (time.perf_counter() - w0, time.process_time() - c0)
                if not r:
                    continue  # the first follows another width's round
                f, h, s = kernels.spent["ig_forward"], kernels.spent["ig_logits"], drawn.spent["sample_rows"]
                parts["round"].append(whole)
                parts["forward"].append(tuple(f))
                parts["lm_head"].append(tuple(h))
                parts["sampling"].append(tuple(s))
                parts["rest"].append(tuple(whole[i] - f[i] - h[i] - s[i] for i in (0, 1)))
            out[n] = {k: tuple(statistics.median(x[i] for x in v) * 1e3 for i in (0, 1)) for k, v in parts.items()}
    finally:
        model.lib, cpu_backend.sampler = lib, sampler
    return out


def llama_cpp(python: str, threads: int, reps: int) -> dict | None:
    run = subprocess.run([python, "-c", LLAMA_CPP, str(GGUF), str(threads), str(max(3, reps // 3)), str(CONTEXT),
                          ",".join(map(str, PROMPTS))], capture_output=True, text=True)  # fmt: skip
    if run.returncode:
        print(run.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--llamacpp-python", default="", help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--skip-numpy", action="store_true")
    ap.add_argument("--write", action="store_true")
    ap.add_argument(
        "--spincount", default="", help="GOMP_SPINCOUNT for the kernels' threads (libgomp's default: 300000)"
    )
    args = ap.parse_args()
    if args.spincount:  # read once, when libgomp loads with the kernels (in load below)
        os.environ["GOMP_SPINCOUNT"] = args.spincount
    names = ("cpu",) if args.skip_numpy else ("cpu", "numpy")
    backends = {name: load(name, args.threads) for name in names}
    load_before = os.getloadavg()[0]
    t = bench(backends, args.reps, random.Random(0))
    where = split(backends["cpu"], args.reps, random.Random(1))
    lc = llama_cpp(args.llamacpp_python, args.threads, args.reps) if args.llamacpp_python else None
    body = [
        f"Load average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        f"(a shared machine: every figure is a median of {args.reps} rounds); threads {args.threads} "
        f"(GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}); "
        f"cpu backend ISA {backends['cpu'].isa}, KV cache float16.",
        "",
        "| | " + " | ".join(names) + (" | llama.cpp" if lc else "") + " |",
        "|---|" + "---|" * (len(names) + bool(lc)),
    ]
    for n in WIDTHS:
        cells = [f"{t[name, n] * 1e3:.1f} ms, {n / t[name, n]:.0f} tok/s" for name in names]
        extra = (
            [f"{lc['decode_sampled'] * 1e3:.1f} ms, {1 / lc['decode_sampled']:.0f} tok/s" if n == 1 else "-"]
            if lc
            else []
        )
        body.append(
            f"| decode, {n} lane{'s' if n > 1 else ''} (round, aggregate) | " + " | ".join(cells + extra) + " |"
        )
    for name in names:
        t[name, "ratio"] = t[name, 8] / t[name, 1]
    body.append("| 8-lane round / 1-lane round | " + " | ".join(f"{t[n, 'ratio']:.2f}x" for n in names)
                + (" | -" if lc else "") + " |")  # fmt: skip
    for n in PROMPTS:
        cells = [f"{t[name, f'p{n}']:.3f} s, {n / t[name, f'p{n}']:.0f} tok/s" for name in names]
        extra = [f"{lc['prompt'][str(n)]:.3f} s, {n / lc['prompt'][str(n)]:.0f} tok/s"] if lc else []
        body.append(f"| cold prompt, {n} tokens | " + " | ".join(cells + extra) + " |")
    if lc:
        c = "cpu"
        body += [
            "",
            f"llama.cpp: llama-cpp-python {lc['version']}; its decode row is ``eval`` of one token then ``sample`` "
            f"(temperature 0.7, top-p 0.9, as ours; ``eval`` alone {lc['decode'] * 1e3:.1f} ms). "
            f"Targets (issue 19): one lane >= llama.cpp's stream: "
            f"{1 / t[c, 1]:.0f} vs {1 / lc['decode_sampled']:.0f} tok/s; 8 lanes >= 3x its stream: {8 / t[c, 8]:.0f} vs "
            f"{3 / lc['decode_sampled']:.0f} tok/s; 8-lane round <= 2x the 1-lane round: {t[c, 'ratio']:.2f}x; "
            f"cold 1,000-token "
            f"prompt <= 1.5x llama.cpp's: {t[c, 'p1000']:.3f} vs {1.5 * lc['prompt']['1000']:.3f} s.",
        ]
    body += [
        "",
        "Where a cpu round goes, timed inside `decode_round` (cpu rounds back to back; median wall ms / median "
        "CPU ms of the process, both threads' CPU counted; the rest: the round less the C calls and the sampler):",
        "",
        "| lanes | round | forward (layers, C) | lm_head (C) | sampling (Python) | the rest (staging, cffi) |",
        "|---|---|---|---|---|---|",
    ]
    for n, parts in where.items():
        body.append(f"| {n} | " + " | ".join(f"{w:.1f} / {c:.1f}" for w, c in parts.values()) + " |")
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    report(SECTION, machine=machine, command=command_line(".venv/bin/python"), body=body, write=args.write)


if __name__ == "__main__":
    main()
