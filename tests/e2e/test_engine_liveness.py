"""Issue 11 point 5, in scaled mode: `kill -9` of `runengine` with streams open. The front end
misses the engine's heartbeats, ends the open streams with an engine_error event, answers new
requests 503 engine_unavailable with Retry-After, says so on /health, and serves again by
itself once a new `runengine` announces itself."""

from __future__ import annotations

import shutil
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.server import LiveProcess, free_port, migrate, server_env, start_server, wait_healthy
from tests.helpers import assert_openai_error, wait_for

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
LONG = [{"role": "user", "content": "Count from one to two hundred in words, separated by commas."}]


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


def test_a_killed_engine_ends_open_streams_refuses_new_requests_and_service_resumes(tmp_path, redis_url):
    env_extra = {"IGNIS_SERVER_REDIS_URL": redis_url, "IGNIS_SERVER_ENGINE_TIMEOUT": "3"}
    env = server_env(tmp_path, **env_extra)
    migrate(env)
    engine = LiveProcess([sys.executable, "manage.py", "runengine"], env, tmp_path / "engine.log")
    server, base = start_server(tmp_path, env_extra=env_extra)
    # A read timeout well above server.engine_timeout: on a front end that never notices, it fails the test.
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        # /health answers from the engine's first beat, while it still loads: the subject here is a
        # kill while streams run, so they start once the model answers (a clean-clone run under load
        # saw the front end take the loading engine for silent and refuse the first stream 503)
        wait_for(
            lambda: client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=1),
            timeout=120,
            message="the default model answering",
            ignoring=(openai.APIStatusError, openai.APIConnectionError),
        )
        streams = []
        for _ in range(4):
            stream = client.chat.completions.create(
                model=MODEL,
                messages=LONG,
                max_tokens=2000,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},  # the model may end its answer early: no stream may finish
            )
            chunks = iter(stream)
            next(chunks)  # it runs
            streams.append(chunks)
        engine.proc.kill()
        engine.proc.wait(10)

        for chunks in streams:
            with pytest.raises(openai.APIError) as err:
                for _ in chunks:
                    pass
            assert not isinstance(err.value, openai.APITimeoutError)
            assert err.value.body["code"] == "engine_error", err.value.body

        resp = httpx.post(base + "/v1/chat/completions", json={"messages": LONG, "max_tokens": 4}, timeout=10)
        assert_openai_error(resp, 503, "engine_unavailable")
        assert resp.headers["retry-after"] == "5"
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=4)
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unreachable"

        engine = LiveProcess([sys.executable, "manage.py", "runengine"], env, tmp_path / "engine2.log")
        wait_healthy(base, server)
        resp = wait_for(
            lambda: httpx.post(base + "/v1/chat/completions", json={"messages": LONG, "max_tokens": 4}, timeout=60),
            60,
            0.5,
            "a chat completion from the new engine",
            until=lambda r: r.status_code == 200,
        )
        assert resp.json()["choices"][0]["message"]["content"]
    finally:
        server.stop()
        engine.stop()
