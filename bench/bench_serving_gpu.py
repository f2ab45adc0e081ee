"""The serving path on the GPU machine: the real server on an 8B-shaped checkpoint, driven by the
official client (issue 15's serving benchmark).

Writes a Llama-3.1-8B-shaped bf16 checkpoint of random weights (bench/bench_load.py's shared
random pool, so 16 GB take seconds) with a 49,152-token vocabulary and the default GGUF's
tokenizer and chat template (SmolLM2's: the text renders), into a fresh models directory beside
the default GGUF; starts ``manage.py serve --model-backend cuda`` on it (Daphne, the embedded
engine, the in-memory Channels layer) and drives 1, 8 and 12 concurrent streamed chats of
``--tokens`` tokens (``ignore_eos``, greedy, speculative rounds off) with bench/bench_serving.py's
streams: client inter-token time (mean, median, p90) while every stream decodes, TTFT, the
aggregate tok/s, and the engine's own decode round from its ``ignis.engine.round`` lines.

On the GPU machine (wheels installed as bench/gpu_server.sh does; ``bash bench/gpu_server.sh
serving`` runs exactly this), from the repo root:

    python3 bench/bench_serving_gpu.py --write
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_gc_pause import pauses, probed, summary  # noqa: E402
from bench.bench_load import write_checkpoint  # noqa: E402
from bench.bench_serving import GGUF, phases_lines, run_streams, start_server, stop_server, table  # noqa: E402
from bench.perfdoc import command_line, report  # noqa: E402

SECTION = "## The serving path on the GPU (H200, issue 15)"
MODEL = "llama-8b-shape"
VOCAB = 49152


# The default GGUF's tokenizer files, saved here by ``--save-tokenizer`` (the GGUF itself is more than
# a device call carries; this directory is 2 MB): used when the GGUF is not in models/.
SAVED_TOKENIZER = ROOT / ".gpu" / "tokenizer"


def save_tokenizer(target: Path) -> tuple[int, int]:
    """tokenizer.json and tokenizer_config.json of the default GGUF into ``target``; its (bos, eos) ids."""
    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(ROOT / "models" / GGUF)
    if bundle.tokenizer.get_vocab_size() > VOCAB:
        raise SystemExit(f"the tokenizer has {bundle.tokenizer.get_vocab_size()} tokens, more than {VOCAB}")
    target.mkdir(parents=True, exist_ok=True)
    bundle.tokenizer.save(str(target / "tokenizer.json"))
    ids = [bundle.tokenizer.token_to_id(t) for t in (bundle.bos_token, bundle.eos_token)]
    config = {"chat_template": bundle.chat_template, "bos_token": bundle.bos_token, "eos_token": bundle.eos_token,
              "ids": ids}  # fmt: skip
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return ids[0], ids[1]


def write_model(models_dir: Path, layers: int) -> int:
    """The checkpoint under ``models_dir/MODEL`` with the default GGUF's tokenizer files; its bytes."""
    target = models_dir / MODEL
    target.mkdir(parents=True, exist_ok=True)
    if (ROOT / "models" / GGUF).exists():
        bos, eos = save_tokenizer(target)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(SAVED_TOKENIZER / name, target / name)
        bos, eos = json.loads((target / "tokenizer_config.json").read_text())["ids"]
    return write_checkpoint(target, layers, vocab=VOCAB, bos=bos, eos=eos)


def set_config(base: str, values: dict) -> None:
    """PATCH /v1/config (a live key: the engine takes it before its next round)."""
    import urllib.request

    req = urllib.request.Request(f"{base}/v1/config", data=json.dumps(values).encode(), method="PATCH",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def log_times(log_path: Path) -> dict[str, float]:
    """The wall-clock ``ts`` of the server log's first line and of its ``ignis.model.loaded`` and
    ``ignis.server.serving`` lines (JSON lines), and the loaded line's ``seconds``."""
    found: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        found.setdefault("first", rec["ts"])
        if rec.get("event") in ("ignis.model.loaded", "ignis.server.serving"):
            found.setdefault(rec["event"], rec["ts"])
            if "seconds" in rec:
                found["seconds"] = rec["seconds"]
    return found


def evict(models_dir: Path) -> None:
    """Drop the checkpoint's pages from the page cache (posix_fadvise DONTNEED): the next load reads the disk."""
    import os

    for f in models_dir.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start_only(tmp: Path, models_dir: Path, port: int, flags: list[str], server_log: str | None) -> None:
    """Start the server on the checkpoint three times: its pages evicted from the page cache and an
    empty kernel cache of its own (``cuda.kernel_cache_dir``), evicted again with that cache warm, and
    both warm. Each: spawn to the first log line (Python, Django, imports), to ``ignis.model.loaded``,
    to ``ignis.server.serving``, to a 200 from /health; and the engine's own load seconds."""
    import os

    cache = tmp / "kernel-cache"
    os.environ["IGNIS_CUDA_KERNEL_CACHE_DIR"] = str(cache)
    head = ("| checkpoint pages, kernel cache | spawn to first log line | to loaded | to serving | to healthy "
            "| ignis.model.loaded seconds |\n|---|---|---|---|---|---|")  # fmt: skip
    rows = []
    for label, cold in (("evicted, empty", True), ("evicted, warm", True), ("cached, warm", False)):
        if cold:
            evict(models_dir)
        data = tmp / label.replace(", ", "-")
        data.mkdir()
        started: list[float] = []
        proc, log_path = start_server(ROOT, port, data, flags, models_dir, started=started)
        healthy = time.time()
        stop_server(proc, 30)
        if server_log:
            shutil.copy2(log_path, f"{server_log}.{label.replace(', ', '-')}")
        t0, ts = started[0], log_times(log_path)

        def at(key: str, ts=ts, t0=t0) -> str:
            return f"{ts[key] - t0:.1f} s" if key in ts else "-"

        rows.append(f"| {label} | {at('first')} | {at('ignis.model.loaded')} | {at('ignis.server.serving')} "
                    f"| {healthy - t0:.1f} s | {ts.get('seconds', '-')} s |")  # fmt: skip
        print(rows[-1], flush=True)
    print("\n" + head + "\n" + "\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--streams", default="1,8,12", help="concurrent stream counts, comma-separated")
    ap.add_argument("--port", type=int, default=18094)
    ap.add_argument("--label", default="this tree", help="the run's row label")
    ap.add_argument("--write", action="store_true", help="replace this section of docs/PERFORMANCE.md")
    ap.add_argument(
        "--compare-async",
        action="store_true",
        help="each stream count twice, model.async_rounds on then off (set live through /v1/config)",
    )
    ap.add_argument("--server-log", help="copy the server's log here at the end")
    ap.add_argument("--save-tokenizer", action="store_true", help=f"only save the tokenizer to {SAVED_TOKENIZER}")
    ap.add_argument("--start-only", action="store_true",
                    help="only time the server's start to healthy, with an empty and then a warm kernel cache")  # fmt: skip
    ap.add_argument("--gc-probe", action="store_true",
                    help="time the server's garbage collections (bench/gc_probe) over the measured streams")  # fmt: skip
    ap.add_argument("flags", nargs="*", help="extra flags for manage.py serve (after --)")
    args = ap.parse_args()
    if args.save_tokenizer:
        save_tokenizer(SAVED_TOKENIZER)
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    # 16 decode lanes: 12 streams at once fit one round (8, the default, answers the 9th 503 "busy";
    # seen on the GPU machine), and a bf16 round takes 16 rows in one graph.
    flags = ["--model-id", MODEL, "--model-path", MODEL, "--model-backend", "cuda", "--spec-enabled", "false",
             "--spec-decode-lanes", "16"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ignis-bench-serving-gpu-") as tmp:
        models_dir = Path(tmp) / "models"
        t = time.perf_counter()
        nbytes = write_model(models_dir, args.layers)
        print(f"wrote {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s", flush=True)
        if args.start_only:
            start_only(Path(tmp), models_dir, args.port, flags + args.flags, args.server_log)
            return
        t = time.perf_counter()
        probe = Path(tmp) / "gc.jsonl"
        with probed(probe) if args.gc_probe else contextlib.nullcontext():
            proc, log_path = start_server(ROOT, args.port, Path(tmp), flags + args.flags, models_dir)
        ready = time.perf_counter() - t
        base = f"http://127.0.0.1:{args.port}"
        try:
            run_streams(base, MODEL, log_path, 1, 16)  # warm: lazy imports, the first request's caches
            # and a burst as wide as the widest measured, on other prompts: the kernels and paths a burst
            # takes first (prefill over a claimed prefix, groups, wide rounds) are loaded before it is timed
            widest = max(int(n) for n in args.streams.split(","))
            run_streams(base, MODEL, log_path, widest, 16, lead="Briefly: ")
            measured_from = time.time()
            modes = (True, False) if args.compare_async else (None,)
            figures = {m: [] for m in modes}
            for n in args.streams.split(","):
                for m in modes:
                    if m is not None:
                        set_config(base, {"model.async_rounds": m})
                    figures[m].append(run_streams(base, MODEL, log_path, int(n), args.tokens))
            measured_to = time.time()
            time.sleep(0.6 if args.gc_probe else 0)  # the probe writes every half second
        finally:
            if args.server_log:
                shutil.copy2(log_path, args.server_log)
            stop_server(proc, 30)
        gc_line = None
        if args.gc_probe:
            gens = pauses(probe, measured_from, measured_to)
            gc_line = (f"Garbage collections while measured ({measured_to - measured_from:.1f} s; count / total ms / "
                       f"longest ms): {summary(gens)}.")  # fmt: skip
    backend = args.flags[args.flags.index("--model-backend") + 1] if "--model-backend" in args.flags[:-1] else "cuda"
    tree = commit.stdout.strip() or None
    names = {None: args.label, True: f"{args.label}, async rounds on", False: f"{args.label}, async rounds off"}
    runs = [{"label": names[m], "commit": tree, "figures": f} for m, f in figures.items()]
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True).stdout.strip() or gpu
    body = table(runs) + [
        "",
        f"Model: the Llama-3.1-8B shape ({args.layers} layers), random bf16 weights ({nbytes / 1e9:.2f} GB), "
        f"vocabulary {VOCAB} with SmolLM2's tokenizer; {backend} backend; {args.tokens} tokens a stream "
        "(`ignore_eos`), greedy, speculative rounds off; one openai client and thread per stream, all released "
        "together. Inter-token gaps and aggregate tok/s only while every stream decodes; engine round = the "
        "backend's decode round (`ignis.engine.round`), cadence = from one round's line to the next. "
        f"Server start to healthy (load, kernels, graphs): {ready:.1f} s. Tree: {tree}."
        + (
            " Async rounds on and off alternate per stream count (one server, the key set live)."
            if args.compare_async
            else ""
        ),
    ]
    for run in runs:  # issue 15's burst figure: the last first token of the widest burst against one stream's
        by_n = {f["streams"]: f for f in run["figures"]}
        if 1 in by_n and max(by_n) > 1:
            one, wide = by_n[1]["ttft_median"], by_n[max(by_n)]
            body.append(f"Burst ({run['label']}): the last of {wide['streams']} first tokens {wide['ttft_max'] * 1e3:.1f} ms, "
                        f"{wide['ttft_max'] / one:.2f}x one stream's {one * 1e3:.1f} ms.")  # fmt: skip
    body += phases_lines(runs)
    if gc_line:
        body.append(gc_line)
    machine = f"{gpu}, Python {platform.python_version()}"
    report(SECTION, machine=machine, command=command_line("python3"), body=body, write=args.write)


if __name__ == "__main__":
    main()
