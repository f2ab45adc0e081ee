"""Prompts sent together on the CUDA backend: prefilled one by one against one group (issue 15 point 4).

On a Llama-3.1-8B-shaped model with random bf16 weights (bench_cuda.build_model), for each prompt
length: ``--prompts`` prompts prefilled one after another with ``CudaBackend.prefill`` (the
scheduler without groups: the last prompt's first token waits for all of them) against the same
prompts in one ``CudaBackend.prefill_group`` (every first token at once). Wall time, median of
``--reps``. Prints one table headed by the machine, date and command; writes nothing.

    python3 bench/bench_prefill_group.py
    python3 bench/bench_prefill_group.py --layers 32 --prompts 8 --lengths 32 64 256
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn, arg, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8, help="prompts sent together")
    ap.add_argument("--lengths", type=int, nargs="*", default=[32, 64, 256], help="tokens a prompt")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernel-cache-dir", default="", help="compiled kernels (default: models/.cache/pycuda)")
    args = ap.parse_args()

    import torch

    from bench.bench_cuda import build_model
    from bench.perfdoc import command_line, report
    from engine.backend import PrefillSpan, SampleRequest, StepOutput
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.sampling import SamplingParams

    torch.cuda.init()
    gpu = torch.cuda.get_device_name(0)
    model, cfg = build_model(args.layers)
    be = CudaBackend(CudaTuning(kernel_cache_dir=args.kernel_cache_dir))
    be.load(cfg, dict(model.state_dict()), block_size=16, kv_budget_bytes=8 << 30, host_kv_budget_bytes=0,
            max_context=4096)  # fmt: skip
    del model
    torch.cuda.empty_cache()
    rng = np.random.default_rng(0)
    greedy = SampleRequest(params=SamplingParams(temperature=0.0), seed=1)
    seq_blocks = -(-max(args.lengths) // 16)

    def spans(n: int) -> list[PrefillSpan]:
        return [PrefillSpan(seq_id=i, token_ids=rng.integers(0, cfg.vocab_size, n).tolist(), start_pos=0,
                            block_table=list(range(i * seq_blocks, (i + 1) * seq_blocks)), sample=greedy)
                for i in range(args.prompts)]  # fmt: skip

    def alone(group: list[PrefillSpan]) -> None:
        for span in group:
            be.prefill(span, StepOutput())

    def together(group: list[PrefillSpan]) -> None:
        be.prefill_group(group, [StepOutput() for _ in group])

    k = args.prompts
    table = [f"| prompt | one prompt alone | {k} one by one (TTFT of the last) | {k} as one group | group / one |",
             "|---|---|---|---|---|"]  # fmt: skip
    for n in args.lengths:
        group = spans(n)
        together(group)  # warm-up (tensor maps, the GEMM variants of these widths)
        alone(group)
        one = timed(alone, group[:1], args.reps)
        t_alone = timed(alone, group, args.reps)
        t_group = timed(together, group, args.reps)
        table.append(f"| {n} tokens | {one * 1e3:.2f} ms | {t_alone * 1e3:.2f} ms | {t_group * 1e3:.2f} ms | "
                     f"{t_group / one:.2f}x |")  # fmt: skip
        print(table[-1], flush=True)
    be.unload()
    machine = f"{gpu}, {platform.node()}, Python {platform.python_version()}, torch {torch.__version__}"
    body = [
        f"Model: Llama-3.1-8B shape, {cfg.num_layers} layers, random bf16 weights, KV pages of 16 tokens; "
        f"{k} prompts, greedy, each to its own pages (the spans of a group of more than "
        f"{be.kern.gemv_cap} tokens run as one pass: engine/backends/cuda/prefill_rows.py). Wall time, median of "
        f"{args.reps}.",
        "",
        *table,
    ]
    report("## Prompts prefilled together (CUDA)", machine=machine, command=command_line("python3"), body=body,
           write=False)  # fmt: skip


if __name__ == "__main__":
    main()
