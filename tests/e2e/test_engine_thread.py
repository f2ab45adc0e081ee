"""The embedded engine loop runs on a thread and event loop of its own, not on Daphne's.

The engine says where it runs from inside its loop (``ignis.server.engine_loop``:
its thread, the server's, whether the loop is Daphne's); streams then go through the
cross-loop layer both ways, and SIGTERM in the middle of a stream still ends the
process (the engine thread is stopped after Daphne has ended the open requests).
"""

from __future__ import annotations

import concurrent.futures
import shutil

import pytest
from openai import OpenAI

from tests.e2e.server import LiveProcess, free_port, server_env, start_server
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"


def stream_text(client: OpenAI, prompt: str, n: int) -> str:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=n,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_the_engine_loop_is_not_daphnes_and_streams_cross_it(tmp_path, default_gguf_path):
    proc, base = start_server(
        tmp_path,
        "--model-idle-unload",
        "0",
        "--server-metrics-bind",
        "",
        env_extra={"IGNIS_SERVER_CELERY_WORKER": "false"},
    )
    try:
        hosted = [e for e in proc.events() if e["event"] == "ignis.server.engine_loop"]
        assert len(hosted) == 1, hosted
        assert hosted[0]["engine_thread"] == "ignis-engine"
        assert hosted[0]["server_thread"] == "MainThread" and hosted[0]["own_loop"] is True

        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        whole = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name three colors."}],
            temperature=0,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda _: stream_text(client, "Name three colors.", 12), range(3)))
        assert texts == [whole.choices[0].message.content] * 3 and texts[0]

        # SIGTERM with a stream open: Daphne ends the request, then the engine thread stops.
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        proc.proc.terminate()
        code = wait_for(proc.proc.poll, 60, 0.2, "the server to exit on SIGTERM", until=lambda rc: rc is not None)
        assert code == 0, proc.log_text()[-3000:]
        assert "Traceback" not in proc.log_text()
    finally:
        proc.stop()


def test_with_engine_over_redis_the_engine_thread_has_its_own_layer(tmp_path, default_gguf_path):
    """``serve --with-engine`` under Redis: the engine thread talks through a channels_redis
    instance of its own (one per loop), the front end through another."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    redis = LiveProcess(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        server_env(tmp_path),
        tmp_path / "redis.log",
    )
    try:
        env_extra = {"IGNIS_SERVER_REDIS_URL": f"redis://127.0.0.1:{port}/0", "IGNIS_SERVER_CELERY_WORKER": "false"}
        proc, base = start_server(tmp_path, "--with-engine", "--server-metrics-bind", "", env_extra=env_extra)
        try:
            hosted = [e for e in proc.events() if e["event"] == "ignis.server.engine_loop"]
            assert len(hosted) == 1 and hosted[0]["own_loop"] is True, hosted
            client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                texts = list(pool.map(lambda _: stream_text(client, "Name three colors.", 8), range(2)))
            assert texts[0] and texts[0] == texts[1]
        finally:
            proc.stop()
    finally:
        redis.stop()
