"""Decode lanes against the live server: eight streams at once, a ninth refused,
prompt reuse across turns and across a burst, and seeds that ignore the batch.

Concurrency is checked, not assumed: a watcher polls ``GET /health`` (the
engine's ``stats``) while the streams run and must see all eight lanes busy
and decoding in the same round.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.server import engine_stats, lanes_busy, start_server
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
LANES = 8
BLOCK = 16  # model.kv_block_size default
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 4242, "max_tokens": 24}
SEEDED_PROMPT = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def lanes_server(tmp_path_factory, default_gguf_path):
    proc, base = start_server(
        tmp_path_factory.mktemp("lanes"),
        "--model-idle-unload",
        "0",
        "--spec-decode-lanes",
        str(LANES),
        "--model-max-context",
        "2048",
    )
    yield base
    proc.stop()


@pytest.fixture(scope="module")
def lane_client(lanes_server) -> OpenAI:
    return OpenAI(base_url=lanes_server + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream_text(client: OpenAI, messages: list[dict], **kw) -> tuple[str, object]:
    """(text, usage) of one streamed chat completion."""
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    )
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    return "".join(pieces), usage


class Watcher(threading.Thread):
    """Polls the engine's stats until stopped; keeps the largest lane counts seen."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base = base
        self.max_busy = self.max_decoding = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            stats = engine_stats(self.base)
            self.max_busy = max(self.max_busy, stats.get("lanes_busy", 0))
            self.max_decoding = max(self.max_decoding, stats.get("lanes_decoding", 0))
            time.sleep(0.05)


def test_eight_streams_at_once_a_ninth_refused_seed_ignores_the_batch(lanes_server, lane_client):
    user = [{"role": "user", "content": SEEDED_PROMPT}]
    stream_text(lane_client, user, **SEEDED)  # computes the prompt cold; from here on its prefix is retained
    alone, _ = stream_text(lane_client, user, **SEEDED)  # the same retained state as the run beside seven
    assert alone

    results: dict[int, tuple[str, object]] = {}
    errors: list[BaseException] = []

    def run(i: int, messages: list[dict], **kw) -> None:
        try:
            results[i] = stream_text(lane_client, messages, **kw)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    watcher = Watcher(lanes_server)
    watcher.start()
    # Seven greedy counters long enough to outlast every prefill (no early stop token),
    # admitted first, so the seeded request prefills last, beside seven decoding lanes.
    threads = [
        threading.Thread(
            target=run,
            args=(i, [{"role": "user", "content": f"List the numbers from {i} to 300, one per line, no words."}]),
            kwargs={"temperature": 0, "max_tokens": 96},
        )
        for i in range(1, LANES)
    ]
    for t in threads:
        t.start()
    wait_for(
        lambda: engine_stats(lanes_server),
        60,
        0.05,
        f"the {LANES - 1} counters to hold lanes",
        until=lambda s: s.get("lanes_busy", 0) >= LANES - 1,
    )
    seeded = threading.Thread(target=run, args=(0, user), kwargs=SEEDED)
    seeded.start()
    threads.append(seeded)
    wait_for(
        lambda: engine_stats(lanes_server),
        60,
        0.05,
        f"all {LANES} lanes busy",
        until=lambda s: s.get("lanes_busy") == LANES,
    )

    with pytest.raises(openai.APIStatusError) as refused:
        lane_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "One more?"}], max_tokens=4
        )
    err = refused.value
    assert isinstance(err, openai.InternalServerError)
    assert err.status_code == 503
    assert int(err.response.headers["retry-after"]) >= 1
    envelope = err.response.json()["error"]
    assert envelope["code"] == "engine_full"
    assert envelope["type"] == "server_error"
    assert envelope["message"]

    for t in threads:
        t.join(timeout=600)
    watcher.done.set()
    watcher.join()
    assert not errors, errors
    assert sorted(results) == list(range(LANES))
    for i in range(1, LANES):
        text, usage = results[i]
        assert str(i + 1) in text, text  # it counted
        assert usage.completion_tokens == 96
    assert watcher.max_busy == LANES
    assert watcher.max_decoding == LANES, "all eight lanes decoded in the same round"
    assert results[0][0] == alone, "a seeded request gives the same text beside seven others"
    assert lanes_busy(lanes_server) == 0


def test_second_turn_reports_cached_tokens(lane_client):
    system = "You are a careful assistant for a ship's crew. " * 6
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Name a knot sailors use."}]
    first = lane_client.chat.completions.create(model=MODEL, messages=turn1, temperature=0, max_tokens=16)
    first_prompt = first.usage.prompt_tokens
    turn2 = turn1 + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "How do you tie it?"},
    ]
    second = lane_client.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens > first_prompt
    # The whole first prompt comes back, less the partly filled last block.
    assert cached >= (first_prompt // BLOCK - 1) * BLOCK > 0
    assert cached % BLOCK == 0 and cached < second.usage.prompt_tokens


def test_a_burst_of_subagents_shares_the_system_block(lanes_server, lane_client):
    """Same system block, different tasks, all at once: every prompt after the
    first prefills only past the shared block, which stays pinned afterwards."""
    system = "You are a subagent. Follow the plan, answer in one short line, and cite the file you read. " * 4
    results: dict[int, object] = {}

    def run(i: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}: say hi."}]
        results[i] = lane_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == [0, 1, 2, 3]
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in results.values())
    count = httpx.post(lanes_server + "/v1/tokenize", json={"messages": [{"role": "system", "content": system}]})
    system_tokens = count.json()["count"]
    assert system_tokens > 4 * BLOCK
    # At most the first of the burst prefilled the system block.
    assert all(c >= (system_tokens // BLOCK - 1) * BLOCK for c in cached[1:]), cached
    assert engine_stats(lanes_server)["kv_pages"]["pinned"] >= system_tokens // BLOCK - 1
