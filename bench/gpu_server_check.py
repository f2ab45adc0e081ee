"""The whole server on the GPU: 8 concurrent streamed chats through the openai client.

Run on the GPU machine after starting ``manage.py serve --model-backend cuda``
(bench/gpu_server.sh does both). Prints one table: per-request tokens, TTFT and
tok/s, the most lanes the engine reported busy at once, and the aggregate rate;
then the greedy answer to "What is 2+2?". Also compares the CUDA and numpy
backends' greedy tokens on the real default model, engine to engine.

    python bench/gpu_server_check.py --base http://127.0.0.1:8080 --gguf models/.../x.gguf
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

PROMPTS = [
    "Name three colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in two sentences.",
    "List four animals that live in the ocean.",
    "What is 12 times 12?",
    "Give me a tip for learning to cook.",
    "Describe a sunset in one sentence.",
]


def stream_one(client: OpenAI, prompt: str, max_tokens: int, out: dict) -> None:
    t0 = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                if first is None:
                    first = time.perf_counter()
                pieces.append(c.delta.content)
    end = time.perf_counter()
    n = usage.completion_tokens if usage else len(pieces)
    out.update(
        prompt=prompt,
        text="".join(pieces),
        tokens=n,
        ttft=(first or end) - t0,
        seconds=end - t0,
        tok_s=(n - 1) / max(end - (first or end), 1e-9) if n > 1 else 0.0,
        chunks=len(pieces),
    )


def watch_lanes(base: str, stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        try:
            stats = (httpx.get(base + "/health", timeout=5).json().get("engine") or {}).get("stats") or {}
            seen.append(int(stats.get("lanes_busy", 0)))
        except Exception:
            pass
        time.sleep(0.05)


def server_check(base: str, max_tokens: int) -> dict:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    answer = (
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            temperature=0,
            max_tokens=48,
        )
        .choices[0]
        .message.content
    )
    solo: dict = {}
    stream_one(client, PROMPTS[0], max_tokens, solo)
    results = [dict() for _ in PROMPTS]
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_lanes, args=(base, stop, seen))
    watcher.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream_one, args=(client, p, max_tokens, r)) for p, r in zip(PROMPTS, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    total = sum(r["tokens"] for r in results)
    return {
        "answer_2_plus_2": answer,
        "solo": solo,
        "concurrent": results,
        "max_lanes_busy": max(seen or [0]),
        "wall_s": wall,
        "aggregate_tok_s": total / wall,
        "all_complete": all(r.get("tokens") for r in results),
    }


def backend_parity(gguf: Path, n_tokens: int = 32) -> list[dict]:
    """Greedy tokens of the numpy and CUDA backends on the real model, prompt by prompt."""
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.backends import create_backend
    from engine.chat_template import render_chat
    from engine.loaders import load_artifact
    from engine.sampling import SamplingParams
    from engine.tokenizer import load_tokenizer

    cfg, weights = load_artifact(gguf)
    tok = load_tokenizer(gguf)
    greedy = SampleRequest(params=SamplingParams(temperature=0), seed=0)
    runs = {}
    for name in ("numpy", "cuda"):
        backend = create_backend(name)
        backend.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
        runs[name] = []
        for prompt in PROMPTS[:4]:
            text = render_chat(
                tok.chat_template,
                [{"role": "user", "content": prompt}],
                bos_token=tok.bos_token,
                eos_token=tok.eos_token,
            )
            ids = tok.encode(text)
            table = list(range((len(ids) + n_tokens) // 16 + 1))
            out = StepOutput()
            backend.prefill(PrefillSpan(0, ids, 0, table, sample=greedy), out)
            toks = [out.prefill_token]
            for i in range(n_tokens - 1):
                out = StepOutput()
                backend.decode_round([DecodeLane(0, toks[-1], len(ids) + i, table, greedy)], out)
                toks.append(out.decode_tokens[0])
            runs[name].append(toks)
        backend.unload()
    rows = []
    for prompt, a, b in zip(PROMPTS, runs["numpy"], runs["cuda"]):
        agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        rows.append({"prompt": prompt, "agree_tokens": agree, "of": len(a), "cuda_text": tok.decode(b)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "command": " ".join(sys.argv),
    }
    report["server"] = server_check(args.base, args.max_tokens)
    if args.gguf:
        report["parity"] = backend_parity(args.gguf)
    s = report["server"]
    print(f"# {report['date']}  {report['machine']}  {report['command']}")
    print(f"2+2 -> {s['answer_2_plus_2']!r}")
    print(f"solo: {s['solo']['tokens']} tokens, TTFT {s['solo']['ttft'] * 1000:.1f} ms, {s['solo']['tok_s']:.1f} tok/s")
    print(
        f"8 concurrent: all complete={s['all_complete']}, max lanes busy={s['max_lanes_busy']}, "
        f"aggregate {s['aggregate_tok_s']:.1f} tok/s over {s['wall_s']:.2f} s"
    )
    print("| prompt | tokens | TTFT ms | tok/s |")
    print("|---|---|---|---|")
    for r in s["concurrent"]:
        print(f"| {r['prompt']} | {r['tokens']} | {r['ttft'] * 1000:.1f} | {r['tok_s']:.1f} |")
    print(f"median per-lane tok/s: {statistics.median(r['tok_s'] for r in s['concurrent']):.1f}")
    for row in report.get("parity", []):
        print(f"parity numpy/cuda: {row['agree_tokens']}/{row['of']} greedy tokens agree — {row['prompt']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if s["all_complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
