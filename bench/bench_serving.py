"""The serving path's overhead: client-observed inter-token time against the engine's round.

Starts the real server (``manage.py serve``, the default model and backend, a fresh
data directory) from a checkout (``--root``, default this one), then drives 1 and 8
concurrent streamed chat completions of ``--tokens`` tokens each (``ignore_eos``, so
every stream runs its full length) with the official openai client, one client and
one thread per stream, all released together. Per stream count it reports:

* client inter-token time (mean, median and p90): the gaps between a stream's content
  chunks, taken only while every stream decodes (after the last first token, before
  the first stream ends), so a prefill in the middle does not count;
* TTFT (median and the slowest), from the request to the first content chunk;
* aggregate tok/s over that all-decode window;
* the engine's own round: the backend's time for each decode round of the window, from
  the engine's DEBUG ``ignis.engine.round`` lines (the server runs with
  ``--server-log-level debug``), mean and median; and the engine's cadence, the wall
  time from one round's line to the next: the round plus whatever sits between two
  rounds on the engine's loop;
* client / round: the client's gap over the engine's round (means; medians), the
  figure issue 15 targets (<= 1.03x at 1 stream, <= 1.05x at 8).

Speculative rounds are off (``--spec-enabled false``) unless ``--spec``: a verify round
commits a varying number of tokens, and then a token's gap is no round's time.

A run appends its figures to ``--results`` (JSON) under ``--label``; ``--write``
renders every run in that file as one table in docs/PERFORMANCE.md. Before / after a
change: run once with ``--root`` at a checkout of the old tree, once on this one.

    .venv/bin/python bench/bench_serving.py --root /tmp/ignis-base --label main --results /tmp/serving.json
    .venv/bin/python bench/bench_serving.py --label "engine thread" --results /tmp/serving.json --write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_numpy import cpu_model  # noqa: E402
from bench.perfdoc import command_line, report  # noqa: E402

SECTION = "## The serving path (issue 15): client inter-token time against the engine's round"
GGUF = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2-135m-instruct"
TINY = "tiny-llama"  # --tiny: tests/models/tiny.py's random 2-layer llama, rounds of a few ms as a GPU's are
PROMPTS = [
    "Tell me a long story about a lighthouse keeper.",
    "Describe, in detail, how bread is baked.",
    "Write a long letter to a friend about autumn.",
    "Explain how a steam engine works, step by step.",
    "Describe a walk through a busy city market.",
    "Tell me about the history of sailing ships.",
    "Write a long poem about the mountains.",
    "Describe the life of a honeybee through one summer.",
]


def start_server(
    root: Path,
    port: int,
    data_dir: Path,
    flags: list[str],
    models_dir: Path | None = None,
    started: list[float] | None = None,
) -> tuple[subprocess.Popen, Path]:
    """``manage.py migrate``, then ``manage.py serve`` until /health says 200: the process and its log.
    ``started`` gets the wall-clock time (``time.time()``) at which the serve process was spawned."""
    env = dict(os.environ, IGNIS_SERVER_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    if models_dir is not None:
        env["IGNIS_SERVER_MODELS_DIR"] = str(models_dir)
    env["IGNIS_SERVER_CELERY_WORKER"] = "false"  # no downloads here: keep its process off the two cores
    python = str(root / ".venv/bin/python") if (root / ".venv/bin/python").exists() else sys.executable
    subprocess.run([python, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=root, env=env, check=True)
    log_path = data_dir / "server.log"
    log = open(log_path, "wb")
    cmd = [python, "manage.py", "serve", "--port", str(port), "--no-download", "--model-idle-unload", "0"]
    cmd += ["--server-log-level", "debug", *flags]  # debug: the engine's ignis.engine.round lines
    if started is not None:
        started.append(time.time())
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            if r.status_code == 200:
                return proc, log_path
            if r.json().get("status") == "failed":  # the load failed: say why now, not after the deadline
                proc.terminate()
                raise RuntimeError(f"the model failed to load:\n{log_path.read_text()[-3000:]}")
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"server never healthy:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, wait: float = 20) -> None:
    """Ask ``start_server``'s process to end (SIGTERM: it drains), killing it after ``wait`` seconds."""
    proc.terminate()
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream_one(base: str, model: str, prompt: str, tokens: int, go: threading.Barrier, out: dict) -> None:
    """One stream; ``out`` gets the send time, when its request went on the wire (after the client
    built it: httpx's request hook), and each content chunk's arrival time."""
    wire = []
    hooks = {"request": [lambda request: wire.append(time.time())]}
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600,
                    http_client=httpx.Client(event_hooks=hooks, timeout=600))  # fmt: skip
    go.wait()
    sent = time.time()  # the server log's clock: its round lines are placed on the same axis
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    arrivals, usage, request_id = [], None, None
    for chunk in stream:
        request_id = request_id or chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        if any(c.delta.content for c in chunk.choices):
            arrivals.append(time.time())
    out.update(sent=sent, wire=wire[0] if wire else sent, arrivals=arrivals, request_id=request_id,
               completion_tokens=usage.completion_tokens if usage else None)  # fmt: skip


def ttft_phases(log_path: Path, results: list[dict]) -> dict[str, float] | None:
    """Where the streams' first tokens spent their time, from the server log's ``ignis.request.admitted``
    and ``ignis.request.ttft`` lines (same clock as the client's): ``client`` = the call to its request
    on the wire (the openai client building it, in a thread of this process), ``in`` = from the wire
    to the engine's admission (HTTP, the consumer, the channel), ``engine`` = admission to the first
    token (the engine's own TTFT), ``out`` = the first token to its arrival at the client (channel,
    SSE, the client's parsing); the median and the largest of each over the streams; and the
    engine's side of the whole burst: ``admit_spread`` (first to last admission) and ``engine_span``
    (first admission to the last first token), and ``prefill_steps``: (seconds, seconds until the
    backend had queued its work, or None) of each step with a prefill logged from the first admission
    until the last first token (``ignis.engine.round``'s ``prefill_seconds`` and, on the CUDA backend,
    ``prefill_queued_seconds``: how much of a prefill step was the host launching it). None when the
    log lacks a stream."""
    ids = {r.get("request_id") for r in results}
    admitted, engine, steps = {}, {}, []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"ignis.engine.round"' in line:
            e = json.loads(line)
            if e.get("prefill_seconds"):
                steps.append((e["ts"], e["prefill_seconds"], e.get("prefill_queued_seconds")))
        elif '"ignis.request.admitted"' in line or '"ignis.request.ttft"' in line:
            e = json.loads(line)
            if e.get("request_id") in ids:
                if e["event"] == "ignis.request.admitted":
                    admitted[e["request_id"]] = e["ts"]
                else:
                    engine[e["request_id"]] = e["ttft"]
    if not all(r.get("request_id") in admitted and r.get("request_id") in engine for r in results):
        return None
    phases = {"client": [], "in": [], "engine": [], "out": []}
    ats, firsts = [], []
    for r in results:
        at, ttft = admitted[r["request_id"]], engine[r["request_id"]]
        phases["client"].append(r["wire"] - r["sent"])
        phases["in"].append(at - r["wire"])
        phases["engine"].append(ttft)
        phases["out"].append(r["arrivals"][0] - at - ttft)
        ats.append(at)
        firsts.append(at + ttft)
    out = {}
    for name, values in phases.items():
        out[f"{name}_median"], out[f"{name}_max"] = statistics.median(values), max(values)
    out["admit_spread"], out["engine_span"] = max(ats) - min(ats), max(firsts) - min(ats)
    out["prefill_steps"] = [[s, q] for ts, s, q in steps if min(ats) <= ts <= max(firsts) + 0.005]
    return out


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def engine_rounds(log_path: Path, start: float, end: float, lanes: int) -> list[tuple[float, float, bool]]:
    """(log time, decode seconds, planned ahead) of the decode-only rounds of ``lanes`` lanes logged in
    [start, end]."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"ignis.engine.round"' not in line:
            continue
        e = json.loads(line)
        if start <= e["ts"] <= end and e["lanes"] == lanes and not e["prefill_seconds"]:
            out.append((e["ts"], e["decode_seconds"], bool(e.get("ahead"))))
    return out


def run_streams(base: str, model: str, log_path: Path, n: int, tokens: int, lead: str = "") -> dict:
    """``n`` streams of ``tokens`` released together, PROMPTS in turn (each after ``lead``: a warm-up's
    prompts that share no more than the chat template's start with the measured ones)."""
    results = [dict() for _ in range(n)]
    go = threading.Barrier(n + 1)
    threads = [
        threading.Thread(target=stream_one, args=(base, model, lead + PROMPTS[i % len(PROMPTS)], tokens, go, r))
        for i, r in enumerate(results)
    ]
    for t in threads:
        t.start()
    go.wait()
    for t in threads:
        t.join()
    if any(len(r.get("arrivals", ())) < 2 for r in results):
        raise RuntimeError(f"a stream came back short: {[len(r.get('arrivals', ())) for r in results]}")
    start = max(r["arrivals"][0] for r in results)  # every stream decodes from here ...
    end = min(r["arrivals"][-1] for r in results)  # ... to here
    gaps, chunks = [], 0
    for r in results:
        a = r["arrivals"]
        gaps += [b - x for x, b in zip(a, a[1:]) if x >= start and b <= end]
        chunks += sum(1 for t in a if start < t <= end)
    logged = engine_rounds(log_path, start, end, n)
    rounds = [seconds for _, seconds, _ in logged]
    cadence = (logged[-1][0] - logged[0][0]) / (len(logged) - 1) if len(logged) > 1 else None
    ttfts = [r["arrivals"][0] - r["sent"] for r in results]
    return {
        "streams": n,
        "tokens": tokens,
        "itl_mean": statistics.fmean(gaps) if gaps else None,
        "itl_median": statistics.median(gaps) if gaps else None,
        "itl_p90": quantile(gaps, 0.9) if gaps else None,
        "num_gaps": len(gaps),
        "ttft_median": statistics.median(ttfts),
        "ttft_max": max(ttfts),
        "agg_tok_s": chunks / (end - start) if end > start else None,
        "round": statistics.fmean(rounds) if rounds else None,
        "round_median": statistics.median(rounds) if rounds else None,
        "cadence": cadence,
        "num_rounds": len(rounds),
        "ahead_share": sum(a for *_, a in logged) / len(logged) if logged else None,
        "ttft_phases": ttft_phases(log_path, results),
    }


def table(runs: list[dict]) -> list[str]:
    def ms(v):
        return f"{v * 1000:.1f}" if v else "-"

    def ratio(a, b):
        return f"{a / b:.3f}x" if a and b else "-"

    def share(v):
        return f"{v:.0%}" if v is not None else "-"

    def load(v):
        return f"{v:.2f}" if v is not None else "-"

    def over(r):
        return f"{(r['itl_mean'] - r['round']) * 1000:.1f}" if r["itl_mean"] and r["round"] else "-"

    lines = [
        "| tree | streams | client inter-token mean / median / p90 (ms) | engine round mean / median (ms) "
        "| client / round: means; medians | engine cadence (ms) | client - round (ms) | TTFT median / max (ms) "
        "| aggregate tok/s | rounds planned ahead | load |",
        "|" + "---|" * 11,
    ]
    for run in runs:
        for r in run["figures"]:
            lines.append(
                f"| {run['label']} | {r['streams']} | {ms(r['itl_mean'])} / {ms(r['itl_median'])} / "
                f"{ms(r['itl_p90'])} | {ms(r['round'])} / {ms(r['round_median'])} "
                f"| {ratio(r['itl_mean'], r['round'])}; {ratio(r['itl_median'], r['round_median'])} "
                f"| {ms(r['cadence'])} | {over(r)} | {ms(r['ttft_median'])} / {ms(r['ttft_max'])} "
                f"| {r['agg_tok_s']:.1f} | {share(r.get('ahead_share'))} | {load(run.get('load'))} |"
            )
    return lines


def phases_lines(runs: list[dict]) -> list[str]:
    """Each stream count's TTFT split (``ttft_phases``) as a line: where the first tokens waited."""
    lines = []
    for run in runs:
        for r in run["figures"]:
            p = r.get("ttft_phases")
            if p:
                parts = "; ".join(
                    f"{k} {p[k + '_median'] * 1e3:.1f} / {p[k + '_max'] * 1e3:.1f}"
                    for k in ("client", "in", "engine", "out")
                )
                span = ""
                if "engine_span" in p:  # runs saved before it have none
                    span = (f" Admissions over {p['admit_spread'] * 1e3:.1f} ms; the last first token "
                            f"{p['engine_span'] * 1e3:.1f} ms after the first admission.")  # fmt: skip
                steps = p.get("prefill_steps")
                if steps:
                    span += " Prefill steps meanwhile (ms" + (
                        ", queued on the host by" if any(q for _, q in steps) else ""
                    )
                    span += (
                        "): " + ", ".join(f"{s * 1e3:.1f}" + (f" ({q * 1e3:.1f})" if q else "") for s, q in steps) + "."
                    )
                lines.append(f"TTFT split ({run['label']}, {r['streams']} streams; median / max ms): {parts}.{span}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose manage.py serve is measured")
    ap.add_argument("--label", default="this tree", help="the run's row label")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument("--streams", default="1,8", help="concurrent stream counts, comma-separated")
    ap.add_argument("--port", type=int, default=18093)
    ap.add_argument("--results", type=Path, default=None, help="JSON file the run is appended to")
    ap.add_argument("--write", action="store_true", help="render every run in --results into docs/PERFORMANCE.md")
    ap.add_argument(
        "--spec", action="store_true", help="keep speculative rounds (then a round may commit several tokens)"
    )
    ap.add_argument(
        "--async-rounds",
        choices=("on", "off", "default"),
        default="default",
        help="model.async_rounds for the server (rounds planned ahead, docs/ARCHITECTURE.md); default: the tree's",
    )
    ap.add_argument("flags", nargs="*", help="extra flags for manage.py serve (after --)")
    ap.add_argument("--tiny", action="store_true", help="serve tests/models/tiny.py's 2-layer llama (ms rounds)")
    ap.add_argument("--render", action="store_true", help="run nothing: print (and --write) the runs in --results")
    args = ap.parse_args()
    flags = args.flags if args.spec else ["--spec-enabled", "false", *args.flags]
    if args.async_rounds != "default":
        flags = ["--model-async-rounds", "true" if args.async_rounds == "on" else "false", *flags]
    if args.render:
        render(json.loads(args.results.read_text()), args)
        return
    root = args.root.resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    model = TINY if args.tiny else MODEL
    with tempfile.TemporaryDirectory(prefix="ignis-bench-serving-") as tmp:
        models_dir = None
        if args.tiny:
            from tests.models.tiny import models_dir_with_two

            models_dir = models_dir_with_two(Path(tmp) / "models", ROOT / "models" / GGUF)
            flags = ["--model-id", TINY, "--model-path", TINY, *flags]
        proc, log_path = start_server(root, args.port, Path(tmp), flags, models_dir)
        base = f"http://127.0.0.1:{args.port}"
        try:
            run_streams(base, model, log_path, 1, 16)  # warm: the first request pays for lazy imports and caches
            figures = [run_streams(base, model, log_path, int(n), args.tokens) for n in args.streams.split(",")]
        finally:
            stop_server(proc)
    run = {"label": args.label, "root": str(root), "commit": commit.stdout.strip() or None, "figures": figures}
    run["model"] = model
    run["async_rounds"] = args.async_rounds
    run["load"] = os.getloadavg()[0]  # the 1-minute load average as the run ended (a shared machine)
    runs = [run]
    if args.results:
        previous = json.loads(args.results.read_text()) if args.results.exists() else []
        runs = [r for r in previous if r["label"] != args.label] + [run]
        args.results.write_text(json.dumps(runs, indent=1))
    render(runs, args)


def render(runs: list[dict], args) -> None:
    body = (
        table(runs)
        + [
            "",
            f"Model {'tiny-llama (tests/models/tiny.py: 2 layers, hidden 64, random weights)' if args.tiny else MODEL + ' (GGUF Q4_1)'}, "
            f"cpu backend, {args.tokens} tokens a stream (`ignore_eos`), greedy, "
            + ("speculative rounds on, " if args.spec else "speculative rounds off (one token a stream a round), ")
            + "one openai client and thread per stream. Inter-token gaps and aggregate tok/s only while every stream "
            "decodes; engine round = the backend's decode round (the engine's `ignis.engine.round` log lines), cadence = "
            "wall time from one round's line to the next. Trees: "
            + "; ".join(f"{r['label']} = {r['commit'] or r['root']}" for r in runs)
            + ".",
        ]
        + phases_lines(runs)
    )
    machine = f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    report(SECTION, machine=machine, command=command_line(".venv/bin/python"), body=body, write=args.write)


if __name__ == "__main__":
    main()
