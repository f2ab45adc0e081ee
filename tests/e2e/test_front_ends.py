"""serve --server-front-ends N: the engine and N HTTP front ends, processes of one host on one port."""

from __future__ import annotations

import os
import signal

import pytest
from openai import OpenAI

from tests.e2e.server import start_server
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is 2+2?"}]


def test_two_front_ends_and_the_engine_serve_one_port_and_stop_together(tmp_path, default_gguf_path):
    server, base = start_server(tmp_path, "--server-front-ends", "2")
    children = []
    try:
        # Fresh clients, fresh connections: the kernel spreads them over both front ends.
        answers = []
        for _ in range(4):
            client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            answers.append(client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=ASK))
            stream = client.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=24, messages=ASK, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert streamed == answers[-1].choices[0].message.content
        assert len({a.choices[0].message.content for a in answers}) == 1
        assert "4" in answers[0].choices[0].message.content
        events = server.events()
        started = [e for e in events if e.get("event") == "ignis.server.front_end_started"]
        assert sorted(e["child"] for e in started) == ["engine", "front-end-0", "front-end-1"]
        children = [e["pid"] for e in started]
        assert any(e.get("event") == "ignis.server.channel_hub" for e in events)
        done = [e for e in events if e.get("event") == "ignis.request.done"]
        assert len(done) >= 8  # the engine's process logs into the same stream
        assert server.log_text().count("ignis serving") == 1  # one front end announces
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        server.stop()
    assert code == 0
    for pid in children:  # every child went with the parent

        def gone(pid=pid) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(gone, 30, 0.2, f"child {pid} to exit")
