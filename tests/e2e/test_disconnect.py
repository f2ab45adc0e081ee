"""A client that goes away frees its lane within a round: read from the engine's own state."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from tests.e2e.server import engine_stats, lanes_busy
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
BODY = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "Tell a very long story."}],
    "max_tokens": 3000,
    "temperature": 0,
    "stream": True,
}


def wait_lanes_free(base: str, timeout: float = 10.0) -> dict:
    """The engine's stats once no lane is busy (``timeout`` bounds "within a round" generously)."""
    return wait_for(
        lambda: engine_stats(base), timeout, 0.05, "every lane to be free", until=lambda s: s.get("lanes_busy") == 0
    )


def test_dropped_sse_client_frees_its_lane(live_server_url):
    wait_lanes_free(live_server_url)
    aborted = engine_stats(live_server_url)["aborted"]
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", live_server_url + "/v1/chat/completions", json=BODY) as resp,
    ):
        lines, busy = 0, None
        for line in resp.iter_lines():
            lines += line.startswith("data: ")
            if lines == 3:
                busy = lanes_busy(live_server_url)  # read while still connected
            if lines >= 4:
                break  # leaving the iterator closes the connection (httpcore closes on GeneratorExit)
        assert busy == 1
    # The connection is closed here, mid-stream.
    wait_lanes_free(live_server_url, timeout=5.0)
    assert engine_stats(live_server_url)["aborted"] == aborted + 1


CHILD = """
import sys, httpx, json
with httpx.stream("POST", sys.argv[1] + "/v1/chat/completions", json=json.loads(sys.argv[2]), timeout=60) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print("chunk", flush=True)
"""


def test_killed_client_process_frees_its_lanes(live_server_url):
    wait_lanes_free(live_server_url)
    body = {**BODY, "n": 2}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, live_server_url, json.dumps(body)], stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(3):
            assert child.stdout.readline().strip() == "chunk"
        assert lanes_busy(live_server_url) == 2
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(10)
    wait_lanes_free(live_server_url, timeout=5.0)


def test_non_streaming_client_that_times_out_frees_its_lane(live_server_url):
    wait_lanes_free(live_server_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server_url + "/v1/chat/completions", json={**BODY, "stream": False}, timeout=2.0)
    wait_lanes_free(live_server_url, timeout=5.0)
