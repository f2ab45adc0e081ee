"""A bounded soak of a fleet (issue 18): two workers serving two models behind one front end, on
Redis and PostgreSQL, with 8 concurrent streams naming a random served model and 10% of the
clients going away mid-stream.

It reports requests sent = answered + disconnected (by the client, on purpose) + refused (by
error code); a request that neither ends nor fails within --request-timeout is a hang (there must
be none). At the end every worker's lanes and KV pages must be back to zero.

    .venv/bin/python bench/fleet_soak.py                 # 10 minutes
    .venv/bin/python bench/fleet_soak.py --minutes 1 --out /tmp/soak.json

Redis: a private redis-server on a free port (nothing shared is touched). PostgreSQL:
--database-admin (default postgresql://postgres@127.0.0.1:5432/postgres), a database of this
run's own, dropped at the end. Models: the tiny llamas of tests/fleet (numpy backend).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import LiveProcess, free_port, migrate, server_env, wait_healthy  # noqa: E402
from tests.fleet.conftest import tiny_models  # noqa: E402

MODELS = ("tiny-a", "tiny-b")
PROMPTS = ["Say something.", "Name three colors.", "Count to ten.", "What is 2+2?", "Write a haiku about rain."]


def start_fleet(root: Path, database_url: str, redis_url: str, *, backend: str = "numpy", gguf: bool = False):
    """Two workers (soak-a, soak-b) and a front end. ``gguf``: both serve the default GGUF as
    ``smollm2-135m-instruct`` (one model on two workers); else tiny-a and tiny-b (two models)."""
    models = tiny_models(root / "models", _default_gguf())
    served = {"soak-a": "tiny-a", "soak-b": "tiny-b"}
    if gguf:
        path = str(next((models / "smollm2-135m-instruct").glob("*.gguf")).relative_to(models))
        served = {"soak-a": ("smollm2-135m-instruct", path), "soak-b": ("smollm2-135m-instruct", path)}
    else:
        served = {w: (m, m) for w, m in served.items()}
    env = server_env(
        root,
        IGNIS_SERVER_REDIS_URL=redis_url,
        IGNIS_SERVER_DATABASE_URL=database_url,
        IGNIS_SERVER_MODELS_DIR=str(models),
        IGNIS_MODEL_BACKEND=backend,
        IGNIS_MODEL_CPU_THREADS="1",
        IGNIS_SERVER_ENGINE_HEARTBEAT="0.25",
        IGNIS_SERVER_WORKER_TIMEOUT="10",  # a shared 2-core machine can stall a worker for seconds
        IGNIS_MODEL_IDLE_UNLOAD="0",
        IGNIS_SERVER_METRICS_BIND="",
        IGNIS_SERVER_LOG_LEVEL="warning",
    )
    migrate(env)
    procs = []
    for worker_id, (model, path) in served.items():
        worker_env = {**env, "IGNIS_MODEL_ID": model, "IGNIS_MODEL_PATH": path}
        cmd = [sys.executable, "manage.py", "runengine", "--worker-id", worker_id]
        procs.append(LiveProcess(cmd, worker_env, root / f"{worker_id}.log"))
    port = free_port()
    model, path = served["soak-a"]
    front_env = {**env, "IGNIS_MODEL_ID": model, "IGNIS_MODEL_PATH": path}
    front = LiveProcess([sys.executable, "manage.py", "serve", "--port", str(port)], front_env, root / "front.log")
    procs.append(front)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, front)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        listed = httpx.get(base + "/v1/models", timeout=10).json().get("workers", [])
        if {w["id"] for w in listed if w["status"] == "serving"} == {"soak-a", "soak-b"}:
            return base, procs
        time.sleep(0.5)
    raise RuntimeError("the two workers never showed up in GET /v1/models")


def _default_gguf() -> Path:
    """The default GGUF (its tokenizer and template go into the tiny models); `make serve` fetches it."""
    found = sorted((ROOT / "models" / "smollm2-135m-instruct").glob("*.gguf"))
    if not found:
        raise SystemExit("no default GGUF under models/smollm2-135m-instruct: run `make serve` once")
    return found[0]


def one_request(client: httpx.Client, base: str, rng: random.Random, timeout: float) -> tuple[str, str]:
    """(outcome, detail): answered | disconnected | refused (detail: the error code) | hung."""
    model = rng.choice(MODELS)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(8, 96),
        "temperature": rng.choice([0, 0.7]),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    disconnect_after = rng.randint(1, 6) if rng.random() < 0.10 else None
    try:
        with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                code = (json.loads(resp.read() or b"{}").get("error") or {}).get("code")
                return "refused", f"{resp.status_code} {code}"
            chunks = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return "answered", model
                event = json.loads(data)
                if "error" in event:
                    return "refused", f"stream {event['error'].get('code')}"
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    return "disconnected", model  # leaving the with-block closes the connection
            return "refused", "stream ended without [DONE]"
    except httpx.TimeoutException:
        return "hung", model
    except httpx.HTTPError as exc:
        return "refused", f"transport {type(exc).__name__}"


def soak(base: str, minutes: float, streams: int, timeout: float, seed: int) -> dict:
    counts: collections.Counter = collections.Counter()
    details: collections.Counter = collections.Counter()
    lock = threading.Lock()
    stop_at = time.monotonic() + minutes * 60

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client() as client:
            while time.monotonic() < stop_at:
                outcome, detail = one_request(client, base, rng, timeout)
                with lock:
                    counts["sent"] += 1
                    counts[outcome] += 1
                    details[f"{outcome}: {detail}"] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(minutes * 60 + timeout + 30)
    stuck = sum(t.is_alive() for t in threads)
    return {"counts": dict(counts), "details": dict(details), "stuck_clients": stuck}


def workers_settled(base: str, wait: float = 30.0) -> list[dict]:
    """Every worker as GET /v1/models lists it, once lanes and pages are back to zero (or ``wait`` passed)."""
    deadline = time.monotonic() + wait
    while True:
        workers = httpx.get(base + "/v1/models", timeout=10).json().get("workers", [])
        if all(w["lanes_busy"] == 0 and w["kv_pages_used"] == 0 for w in workers) or time.monotonic() > deadline:
            return workers
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--database-admin", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--out", help="write the result as JSON here too")
    parser.add_argument("--backend", default="numpy", help="the workers' model.backend (numpy | cpu)")
    parser.add_argument("--gguf", action="store_true", help="both workers serve the default GGUF (one model)")
    parser.add_argument(
        "--exec",
        dest="command_line",
        help="instead of the soak, run this shell command against the fleet (IGNIS_FLEET_URL, "
        "IGNIS_FLEET_TOKENIZER set; bench/fleet_load.sh) and exit with its status",
    )
    args = parser.parse_args()

    import psycopg

    root = Path(tempfile.mkdtemp(prefix="ignis-fleet-soak-"))
    db = f"ignis_soak_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = psycopg.connect(args.database_admin, autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    database_url = args.database_admin.rsplit("/", 1)[0] + f"/{db}"
    redis_port = free_port()
    redis = LiveProcess(
        [shutil.which("redis-server"), "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""],
        server_env(root),
        root / "redis.log",
    )
    procs = []
    try:
        base, procs = start_fleet(
            root, database_url, f"redis://127.0.0.1:{redis_port}/0", backend=args.backend, gguf=args.gguf
        )
        if args.command_line:
            import subprocess

            env = {**os.environ, "IGNIS_FLEET_URL": base, "IGNIS_FLEET_TOKENIZER": str(root / "models" / "tiny-a")}
            rc = subprocess.run(args.command_line, shell=True, env=env).returncode
            print(json.dumps({"workers_at_end": workers_settled(base)}, indent=2))
            return rc
        started = time.monotonic()
        result = soak(base, args.minutes, args.streams, args.request_timeout, args.seed)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["workers_at_end"] = workers_settled(base)
    finally:
        for proc in procs:
            proc.stop()
        redis.stop()
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        admin.close()
    counts = result["counts"]
    sent = counts.get("sent", 0)
    accounted = sum(counts.get(k, 0) for k in ("answered", "disconnected", "refused"))
    settled = all(w["lanes_busy"] == 0 and w["kv_pages_used"] == 0 for w in result["workers_at_end"])
    result["ok"] = sent == accounted and not counts.get("hung") and not result["stuck_clients"] and settled
    result["machine"] = (
        f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    result["command"] = " ".join(["bench/fleet_soak.py", *sys.argv[1:]])
    result["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(json.dumps(result, indent=2))
    print(
        f"sent {sent} = answered {counts.get('answered', 0)} + disconnected {counts.get('disconnected', 0)} "
        f"+ refused {counts.get('refused', 0)}; hung {counts.get('hung', 0)}; lanes and pages at zero: {settled}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(root, ignore_errors=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
