"""A fleet on this machine's real Redis and PostgreSQL: engine workers (`runengine --worker-id`) and
front ends (`serve`), each its own process, the way docs/FLEET.md starts them.

Redis: 127.0.0.1:6379 with a database number this run locks for itself (so parallel runs never see
each other's heartbeats); a private redis-server where none answers there. PostgreSQL:
127.0.0.1:5432 (trust auth), a database of this run's own, dropped at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import LiveProcess, free_port, migrate, server_env, wait_healthy
from tests.helpers import wait_for
from tests.models.tiny import link_default_gguf, write_tiny_llama

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCK_KEY = "ignis:fleet-test:lock"
TIMEOUT = 3.0  # server.worker_timeout of these fleets
_TINY = Path(os.environ.get("TMPDIR", "/tmp")) / f"ignis-tiny-llama-fleet-{os.getuid()}"


@pytest.fixture(scope="session")
def fleet_redis_url(tmp_path_factory):
    """A Redis database of this run's own: a locked db number on 127.0.0.1:6379, else a private server."""
    import redis

    try:
        for db in range(1, 16):
            conn = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db, socket_timeout=2)
            token = uuid.uuid4().hex
            if conn.set(LOCK_KEY, token, nx=True, ex=3600):
                conn.flushdb()
                conn.set(LOCK_KEY, token, ex=3600)
                yield f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"
                conn.flushdb()
                return
        pytest.fail("every Redis database on 127.0.0.1:6379 is locked by another fleet test run")
    except redis.ConnectionError:
        pass
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("no Redis answers on 127.0.0.1:6379 and redis-server is not installed")
    tmp = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = LiveProcess(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        server_env(tmp),
        tmp / "redis.log",
    )
    yield f"redis://127.0.0.1:{port}/0"
    proc.stop()


@pytest.fixture(scope="session")
def fleet_database_url():
    """A PostgreSQL database of this run's own on 127.0.0.1:5432 (dropped at the end)."""
    import psycopg

    name = f"ignis_fleet_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL does not answer on 127.0.0.1:5432 ({exc})")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def tiny_models(models_dir: Path, default_gguf: Path) -> Path:
    """``tiny-a`` and ``tiny-b``: two tiny llamas of different random weights (same tokenizer)."""
    for name, seed in (("tiny-a", 0), ("tiny-b", 1)):
        cache = _TINY.with_name(f"{_TINY.name}-{seed}")
        if not (cache / "model.safetensors").exists():
            tmp = cache.with_name(cache.name + f".{os.getpid()}")
            write_tiny_llama(tmp, default_gguf, seed=seed)
            shutil.rmtree(cache, ignore_errors=True)
            tmp.rename(cache)
        shutil.copytree(cache, models_dir / name, dirs_exist_ok=True)
    link_default_gguf(models_dir, default_gguf)
    return models_dir


@dataclass
class Fleet:
    """The processes of one fleet and how to start more."""

    root: Path
    env: dict
    workers: dict[str, LiveProcess] = field(default_factory=dict)
    fronts: list[tuple[LiveProcess, str]] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # front end base URL -> its /metrics URL

    def start_worker(self, worker_id: str, model: str, **extra: str) -> LiveProcess:
        n = self.starts[worker_id] = self.starts.get(worker_id, 0) + 1
        env = {**self.env, "IGNIS_MODEL_ID": model, "IGNIS_MODEL_PATH": model, **extra}
        proc = LiveProcess(
            [sys.executable, "manage.py", "runengine", "--worker-id", worker_id],
            env,
            self.root / f"worker-{worker_id}-{n}.log",
        )
        self.workers[worker_id] = proc
        return proc

    def start_front(self) -> tuple[LiveProcess, str]:
        port, metrics_port = free_port(), free_port()
        env = {
            **self.env,
            "IGNIS_MODEL_ID": "tiny-a",
            "IGNIS_MODEL_PATH": "tiny-a",
            "IGNIS_SERVER_METRICS_BIND": f"127.0.0.1:{metrics_port}",
        }
        self.metrics[f"http://127.0.0.1:{port}"] = f"http://127.0.0.1:{metrics_port}/metrics"
        proc = LiveProcess(
            [sys.executable, "manage.py", "serve", "--port", str(port)], env, self.root / f"front-{port}.log"
        )
        self.fronts.append((proc, f"http://127.0.0.1:{port}"))
        return proc, f"http://127.0.0.1:{port}"

    def worker_ids_seen(self, base: str) -> dict[str, str]:
        """worker id -> its status, as GET /v1/models on the front end at ``base`` lists them."""
        body = httpx.get(base + "/v1/models", timeout=10).json()
        return {w["id"]: w["status"] for w in body.get("workers", [])}

    def wait_listed(self, ids: set[str], timeout: float = 120.0) -> None:
        """Until every front end lists exactly ``ids`` as serving workers."""
        for _proc, base in self.fronts:
            wait_for(
                lambda base=base: self.worker_ids_seen(base),
                timeout,
                0.25,
                f"{base} to list workers {sorted(ids)}",
                until=lambda seen: set(seen) == ids and all(s == "serving" for s in seen.values()),
                ignoring=(httpx.HTTPError,),
            )

    def done_ids(self, worker_id: str) -> list[str]:
        """Request ids the worker's current process logged as done."""
        return [e["request_id"] for e in self.workers[worker_id].events() if e.get("event") == "ignis.request.done"]

    def stop(self) -> None:
        for proc in [p for p, _ in self.fronts] + list(self.workers.values()):
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGKILL)
        for proc in [p for p, _ in self.fronts] + list(self.workers.values()):
            proc.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, fleet_redis_url, fleet_database_url, default_gguf_path):
    """Workers w-a1 and w-a2 serving tiny-a, w-b serving tiny-b; two front ends (default model tiny-a)."""
    root = tmp_path_factory.mktemp("fleet")
    models = tiny_models(root / "models", default_gguf_path)
    env = server_env(
        root,
        IGNIS_SERVER_REDIS_URL=fleet_redis_url,
        IGNIS_SERVER_DATABASE_URL=fleet_database_url,
        IGNIS_SERVER_MODELS_DIR=str(models),
        IGNIS_MODEL_BACKEND="numpy",
        IGNIS_SERVER_ENGINE_HEARTBEAT="0.25",
        IGNIS_SERVER_WORKER_TIMEOUT=str(TIMEOUT),
        IGNIS_SWITCH_DRAIN_TIMEOUT="60",
        IGNIS_MODEL_IDLE_UNLOAD="0",
    )
    migrate(env)
    f = Fleet(root, env)
    try:
        f.start_worker("w-a1", "tiny-a")
        f.start_worker("w-b", "tiny-b")
        f.start_worker("w-a2", "tiny-a")
        for _ in range(2):
            f.start_front()
        for proc, base in f.fronts:
            wait_healthy(base, proc)
        f.wait_listed({"w-a1", "w-a2", "w-b"})
        yield f
    finally:
        f.stop()
