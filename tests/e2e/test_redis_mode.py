"""Scaled mode: channels_redis carries the messages, `runengine` hosts the engine in its own process."""

from __future__ import annotations

import shutil
import sys

import pytest
from openai import OpenAI

from tests.e2e.server import LiveProcess, free_port, migrate, server_env, start_server, wait_healthy

pytestmark = pytest.mark.e2e


@pytest.fixture
def redis_url(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    proc = LiveProcess(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        server_env(tmp_path),
        tmp_path / "redis.log",
    )
    yield f"redis://127.0.0.1:{port}/0"
    proc.stop()


def test_engine_in_its_own_process_over_redis(tmp_path, redis_url, default_gguf_path):
    env_extra = {"IGNIS_SERVER_REDIS_URL": redis_url}
    env = server_env(tmp_path, **env_extra)
    migrate(env)
    engine = LiveProcess([sys.executable, "manage.py", "runengine"], env, tmp_path / "engine.log")
    try:
        server, base = start_server(tmp_path, env_extra=env_extra)
        try:
            wait_healthy(base, server)
            client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            resp = client.chat.completions.create(
                model="smollm2-135m-instruct",
                temperature=0,
                max_tokens=32,
                messages=[{"role": "user", "content": "What is 2+2?"}],
            )
            assert "4" in resp.choices[0].message.content
            stream = client.chat.completions.create(
                model="smollm2-135m-instruct",
                temperature=0,
                max_tokens=32,
                stream=True,
                messages=[{"role": "user", "content": "What is 2+2?"}],
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert streamed == resp.choices[0].message.content
            assert "runengine over Redis" in server.log_text()
            assert "ignis.request.done" in engine.log_text()  # the engine process, not the server, ran it
        finally:
            server.stop()
    finally:
        engine.stop()
