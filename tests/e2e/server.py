"""Start the real server the way README does (manage.py serve) on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveProcess:
    """A child process (server, engine, redis) whose output goes to a log file."""

    def __init__(self, args: list[str], env: dict, log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict]:
        """The structured log so far: one dict per JSON line (``event``, ``level``, ``ts``, fields)."""
        out = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def server_env(data_dir: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.update({"IGNIS_SERVER_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def migrate(env: dict) -> None:
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)


def start_server(data_dir: Path, *flags: str, env_extra: dict | None = None, port: int | None = None):
    """(process, base_url) once /health says the engine serves."""
    port = port or free_port()
    env = server_env(data_dir, **(env_extra or {}))
    migrate(env)
    proc = LiveProcess(
        [sys.executable, "manage.py", "serve", "--port", str(port), *flags], env, data_dir / f"server-{port}.log"
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc)
    return proc, base


def engine_stats(base: str) -> dict:
    """The engine's counters from /health; empty while it is momentarily unreachable there (its
    status ask timed out on a loaded machine: ``engine: null``), which polls count as "not yet"."""
    engine = httpx.get(base + "/health", timeout=10).json().get("engine") or {}
    return engine.get("stats") or {}


def lanes_busy(base: str) -> int | None:
    """The engine's busy lanes from /health; None while the engine is unreachable there."""
    return engine_stats(base).get("lanes_busy")


def wait_healthy(base: str, proc: LiveProcess, timeout: float = 180.0) -> None:
    """Return once GET /health answers 200; fail with the server's log if it exits or never does."""

    def healthy() -> int:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.proc.returncode}):\n{proc.log_text()[-4000:]}")
        return httpx.get(base + "/health", timeout=5).status_code

    try:
        wait_for(
            healthy,
            timeout,
            0.5,
            f"GET {base}/health to answer 200",
            until=lambda code: code == 200,
            ignoring=(httpx.HTTPError,),
        )
    except AssertionError as exc:
        proc.stop()
        raise RuntimeError(f"{exc}\n{proc.log_text()[-4000:]}") from None
