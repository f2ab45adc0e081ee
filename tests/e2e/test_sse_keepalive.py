"""Issue 11 point 13: a stream sends its headers at once and ': keepalive' while its prompt prefills.

Before: nothing at all (not even the headers) until the first token, so a long
prefill on the CPU outlasted a proxy's read timeout. A server with a short
``server.sse_keepalive`` and small prefill chunks makes the prefill take many
steps; the headers must come within a second, comments before the first
token, and the official client must read the stream as before (it skips comments).
"""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from tests.e2e.server import start_server

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 1800


@pytest.fixture(scope="module")
def slow_prefill(tmp_path_factory, default_gguf_path):
    proc, base = start_server(
        tmp_path_factory.mktemp("keepalive"),
        "--model-idle-unload",
        "0",
        "--server-sse-keepalive",
        "0.2",
        "--model-prefill-chunk",
        "16",
    )
    # The first request pays one-time loading (before any stream exists); measure warm requests.
    httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=120)
    yield base
    proc.stop()


def test_headers_at_once_and_keepalive_while_prefilling(slow_prefill):
    body = {"model": MODEL, "prompt": [[1000 + i % 500 for i in range(PROMPT_TOKENS)]], "max_tokens": 2, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", slow_prefill + "/v1/completions", json=body, timeout=120) as resp:
        headers_at = time.monotonic() - t0
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert headers_at < 1.5, headers_at
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data > 0 and all(line == ": keepalive" for line in lines[:first_data]), lines[: first_data + 1]
    assert lines[-1] == "data: [DONE]"


def test_the_official_client_reads_a_stream_with_comments(slow_prefill):
    client = OpenAI(base_url=slow_prefill + "/v1", api_key="unused", max_retries=0, timeout=120)
    text = ""
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about Paris. " * 100}],
        max_tokens=4,
        temperature=0,
        stream=True,
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
    assert text


def test_a_refusal_at_admission_is_still_an_http_status(slow_prefill):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 10**6, "stream": True}
    resp = httpx.post(slow_prefill + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400


def test_responses_stream_opens_after_keepalives(slow_prefill):
    client = OpenAI(base_url=slow_prefill + "/v1", api_key="unused", max_retries=0, timeout=120)
    events = list(
        client.responses.create(
            model=MODEL, input="Tell me about Paris. " * 150, max_output_tokens=2, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete")
