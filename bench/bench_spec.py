"""Speculative rounds on a real model: single-lane tok/s with speculation on vs off.

Drives the engine directly (Scheduler + backend, no server) on the default GGUF
(SmolLM2-135M-Instruct) with its chat template: prompts whose answer copies the
prompt (edit a function, rename a variable, reformat JSON, continue a list)
and free chat; each greedy, one request at a time. For each: tokens committed
per decode round, drafts accepted / proposed by drafter, and tok/s on vs off;
the rename prompt also runs with its expected answer as a Predicted Outputs
``prediction``. With ``--write`` the table replaces the "Speculative rounds
(<backend>)" section of docs/PERFORMANCE.md.

    python3 bench/bench_spec.py --backend numpy --write
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FUNCTION = "\n".join(
    [
        "def summarize(values):",
        '    """Mean, minimum and maximum of a list of numbers."""',
        "    if not values:",
        "        return None",
        "    total = 0",
        "    low = values[0]",
        "    high = values[0]",
        "    for value in values:",
        "        total += value",
        "        if value < low:",
        "            low = value",
        "        if value > high:",
        "            high = value",
        "    mean = total / len(values)",
        "    return {'mean': mean, 'min': low, 'max': high}",
    ]
)
JSON = '{"name": "ignis", "version": 3, "tags": ["server", "llm", "fast"], "limits": {"lanes": 8, "context": 8192}}'
PROMPTS = {
    "edit a function": f"Add a docstring line saying 'Fast.' to this function and repeat the whole function:\n\n{FUNCTION}",
    "rename a variable": f"Rename the variable 'total' to 'acc' in this code and print the code:\n\n{FUNCTION}",
    "reformat JSON": f"Reformat this JSON with one key per line:\n\n{JSON}",
    "continue a list": "Continue this list: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,",
    "free chat": "Tell me a short story about a lighthouse keeper and a storm.",
}


def run(backend, plan, tok, prompt_ids, max_tokens, *, speculate: bool, prediction=None, cost_aware=False):
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest, TokenEvent
    from engine.scheduler import Scheduler

    cfg = EngineConfig(decode_lanes=1, prefill_chunk=1024, max_context=2048, block_size=16, spec_cost_aware=cost_aware)
    rows = backend.max_round_rows if speculate else 0
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0), max_round_rows=rows)
    add = AddRequest("r", "c", prompt_ids, max_tokens, sampling={"temperature": 0},
                     stop_token_ids=list(tok.eos_token_ids), prediction_token_ids=prediction)  # fmt: skip
    assert sched.add_request(add) is None
    out, rounds, t_first, t0 = [], 0, None, time.perf_counter()
    while sched.has_work:
        step = sched.schedule()
        rounds += bool(step.decode)
        for o in sched.update_from_output(step, backend.step(step)):
            if isinstance(o, TokenEvent):
                if t_first is None:
                    t_first = time.perf_counter()
                out += o.token_ids
    t_end = time.perf_counter()
    st = sched.make_stats()
    decode_s = t_end - (t_first or t0)
    return out, rounds, decode_s, st.spec_drafted, st.spec_accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--model", default=str(ROOT / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--weight-format", default="auto", choices=("auto", "bf16"),
                    help="bf16: dequantize a GGUF's blocks at load (the CUDA backend's 64-row GEMVs; its quantized "
                    "GEMV takes 8 rows)")  # fmt: skip
    ap.add_argument("--cost-aware", action="store_true",
                    help="speculation on with spec.cost_aware (its own section with --write)")  # fmt: skip
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    from bench.perfdoc import command_line, report
    from engine.backends import create_backend
    from engine.chat_template import render_chat
    from engine.loaders import load_artifact
    from engine.tokenizer import load_tokenizer

    backend = create_backend(args.backend)
    stored = getattr(backend, "weights_as_stored", False) and args.weight_format == "auto"
    as_stored = {"as_stored": True} if stored else {}
    cfg, weights = load_artifact(args.model, None, **as_stored)
    tok = load_tokenizer(args.model)
    plan = backend.load(cfg, weights, block_size=16, kv_budget_bytes=None if args.backend == "numpy" else 256 << 20,
                        host_kv_budget_bytes=0, max_context=2048)  # fmt: skip
    del weights
    rows = ["| prompt | tokens | rounds on / off | tokens a round | accepted / drafted | tok/s off | tok/s on | on / off |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cases = [(name, text, None) for name, text in PROMPTS.items()]
    cases.insert(2, ("rename, with prediction", PROMPTS["rename a variable"], FUNCTION.replace("total", "acc")))
    ratios = []
    for name, text, predicted in cases:
        prompt = render_chat(tok.chat_template, [{"role": "user", "content": text}], bos_token=tok.bos_token,
                             eos_token=tok.eos_token, add_generation_prompt=True)  # fmt: skip
        ids = tok.encode(prompt, add_special_tokens=True)
        pred = tok.encode(predicted) if predicted else None
        run(backend, plan, tok, ids, 8, speculate=False)  # warm-up
        off, r_off, s_off, _, _ = run(backend, plan, tok, ids, args.max_tokens, speculate=False)
        on, r_on, s_on, drafted, accepted = run(backend, plan, tok, ids, args.max_tokens, speculate=True,
                                                prediction=pred, cost_aware=args.cost_aware)  # fmt: skip
        assert on == off, f"{name}: speculation changed the output"
        n = len(off)
        d, a = sum(drafted.values()), sum(accepted.values())
        tps_off, tps_on = (n - 1) / s_off, (n - 1) / s_on
        ratios.append(tps_on / tps_off)
        by = ", ".join(f"{k} {accepted.get(k, 0)}/{v}" for k, v in sorted(drafted.items())) or "none"
        rows.append(f"| {name} | {n} | {r_on} / {r_off} | {(n - 1) / max(r_on, 1):.2f} | {a}/{d} ({by}) "
                    f"| {tps_off:.1f} | {tps_on:.1f} | {tps_on / tps_off:.2f}x |")  # fmt: skip
        print(rows[-1], flush=True)
    machine = f"{platform.node()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    if args.backend == "cuda":
        import pycuda.driver as cuda

        from engine.cu import runtime

        with runtime.current():
            machine = f"{cuda.Context.get_device().name()}, {machine}"
    backend.unload()
    fmt = "" if args.weight_format == "auto" else f" ({args.weight_format} weights)"
    body = [
        f"Model: {Path(args.model).name}{fmt} on the {args.backend} backend, round rows {backend.max_round_rows}, greedy, one request at a time, at most "
        f"{args.max_tokens} tokens (its EOS ends it); speculation off vs on (prompt lookup, n-grams 2..4, k "
        f"adaptive up to 8{', spec.cost_aware on' if args.cost_aware else ''}; the prediction row adds Predicted "
        f"Outputs); the output is asserted identical. "
        f"tok/s over the decode phase (after the first token). Median on/off: {statistics.median(ratios):.2f}x.",
        "",
        *rows,
    ]
    title = f"## Speculative rounds ({args.backend}{', spec.cost_aware' if args.cost_aware else ''})"
    report(title, machine=machine, command=command_line("python3"), body=body,
           write=args.write)  # fmt: skip


if __name__ == "__main__":
    main()
