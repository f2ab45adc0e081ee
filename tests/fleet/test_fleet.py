"""Issue 18 on the real Redis and PostgreSQL: three workers (two models, one of them on two
workers) behind two front ends, talked to with the official openai client.

The tests share one fleet and run in file order: routing, a live configuration change, then a
worker killed with `kill -9` (and restarted), then a worker drained by SIGTERM during eight streams.
"""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from tests.fleet.conftest import TIMEOUT
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
ASK = [{"role": "user", "content": "Say something."}]


def client(base: str, timeout: float = 60) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def ask(base: str, model: str, max_tokens: int = 8, **extra):
    return client(base).chat.completions.create(
        model=model, messages=ASK, max_tokens=max_tokens, temperature=0, **extra
    )


def signature(resp) -> tuple:
    """What tells two models' greedy answers apart: the text and each token's logprob (the tiny
    random models may well agree on the tokens, never on their probabilities)."""
    return resp.choices[0].message.content, tuple(round(t.logprob, 3) for t in resp.choices[0].logprobs.content)


def long_stream(base: str, model: str, max_tokens: int):
    """A stream that runs ``max_tokens`` tokens (no early end), started: its first chunk is read."""
    stream = client(base, timeout=30).chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    return first.id, chunks


def test_alternating_models_are_routed_without_a_switch_and_spread_over_workers(fleet):
    answers: dict[str, set[str]] = {"tiny-a": set(), "tiny-b": set()}
    ids: dict[str, list[str]] = {"tiny-a": [], "tiny-b": []}
    for i in range(12):
        _, base = fleet.fronts[i % 2]
        model = ("tiny-a", "tiny-b")[(i // 2) % 2]
        resp = ask(base, model, logprobs=True)
        assert resp.model == model
        answers[model].add(signature(resp))
        ids[model].append(resp.id)
    # Greedy: one answer per model, and the two models (different weights) answer differently.
    assert len(answers["tiny-a"]) == 1 and len(answers["tiny-b"]) == 1, answers
    assert answers["tiny-a"] != answers["tiny-b"]
    # The right worker answered each: tiny-b only on w-b, tiny-a spread over both of its workers.
    wait_for(lambda: len(fleet.done_ids("w-b")) >= 6, 10, 0.1, "w-b's log")
    assert sorted(fleet.done_ids("w-b")) == sorted(ids["tiny-b"])
    on_a1, on_a2 = set(fleet.done_ids("w-a1")), set(fleet.done_ids("w-a2"))
    assert on_a1 | on_a2 == set(ids["tiny-a"]) and not on_a1 & on_a2
    assert on_a1 and on_a2, (on_a1, on_a2)
    # Zero switches anywhere.
    for worker_id, proc in fleet.workers.items():
        assert not [e for e in proc.events() if e.get("event") == "ignis.model.switch_started"], worker_id
    for _, base in fleet.fronts:
        body = client(base).models.list().model_dump()
        assert body.get("last_switch") is None
        by_id = {m["id"]: m for m in body["data"]}
        assert {w["id"] for w in by_id["tiny-a"]["workers"]} == {"w-a1", "w-a2"}
        assert [w["id"] for w in by_id["tiny-b"]["workers"]] == ["w-b"]
        assert {w["id"]: w["model"] for w in body["workers"]} == {"w-a1": "tiny-a", "w-a2": "tiny-a", "w-b": "tiny-b"}
        monitor = httpx.get(base + "/ui/api/monitor", timeout=10).json()  # the Playground's Monitor
        assert sorted(w["id"] for w in monitor["workers"]) == ["w-a1", "w-a2", "w-b"]
        scrape = httpx.get(fleet.metrics[base], timeout=10).text
        for worker_id, model in (("w-a1", "tiny-a"), ("w-a2", "tiny-a"), ("w-b", "tiny-b")):
            assert re.search(rf'ignis_worker_up{{host="[^"]*",model="{model}",worker="{worker_id}"}} 1.0', scrape)


def test_a_live_config_change_reaches_every_worker_and_every_front_end(fleet):
    _, base = fleet.fronts[0]
    resp = httpx.patch(base + "/v1/config", json={"model.decode_share": 0.4}, timeout=60)
    assert resp.status_code == 200 and resp.json()["reload"] is None, resp.text
    for worker_id, proc in fleet.workers.items():
        wait_for(
            lambda proc=proc: [
                e
                for e in proc.events()
                if e.get("event") == "ignis.engine.configured" and (e.get("values") or {}).get("decode_share") == 0.4
            ],
            10,
            0.1,
            f"{worker_id} to apply model.decode_share",
        )
    _, other = fleet.fronts[1]
    wait_for(
        lambda: httpx.get(other + "/v1/config", timeout=10).json()["values"]["model.decode_share"],
        10,
        0.1,
        "the other front end to apply it",
        until=lambda value: value == 0.4,
    )


def test_a_killed_worker_ends_its_streams_the_survivor_serves_and_a_restarted_worker_rejoins(fleet):
    _, base = fleet.fronts[0]
    with ThreadPoolExecutor(4) as pool:  # opened at once, and long: all four still run at the kill
        streams = list(pool.map(lambda _: long_stream(base, "tiny-a", 1500), range(4)))
    victim = fleet.workers["w-a1"]

    def holding() -> set[str]:
        events = victim.events()
        admitted = {e["request_id"] for e in events if e.get("event") == "ignis.request.admitted"}
        return admitted - {e["request_id"] for e in events if e.get("event") == "ignis.request.done"}

    wait_for(holding, 10, 0.1, "w-a1 to hold some of the streams", until=lambda held: held & {s for s, _ in streams})
    held = holding()
    victim.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.proc.wait(10)

    def outcome(stream) -> tuple[str, str | None, float]:
        stream_id, chunks = stream
        try:
            for _ in chunks:
                pass
        except openai.APIError as err:
            assert not isinstance(err, openai.APITimeoutError)
            return stream_id, err.body["code"], time.monotonic() - killed_at
        return stream_id, None, time.monotonic() - killed_at

    with ThreadPoolExecutor(len(streams)) as pool:  # read every stream at once: each ends on its own clock
        outcomes = list(pool.map(outcome, streams))
    ended = {sid: (code, after) for sid, code, after in outcomes if code is not None}
    assert set(ended) == held & {sid for sid, _ in streams}, (outcomes, held)
    for code, after in ended.values():
        assert code == "engine_error"
        assert after < 2 * TIMEOUT  # within twice the heartbeat timeout

    survivor_before = set(fleet.done_ids("w-a2"))
    fleet.wait_listed({"w-a2", "w-b"}, timeout=10)
    new_ids = {ask(base, "tiny-a").id for _ in range(3)}
    wait_for(lambda: new_ids <= set(fleet.done_ids("w-a2")), 10, 0.1, "the survivor to answer them")
    assert new_ids & survivor_before == set()

    fleet.start_worker("w-a1", "tiny-a")  # rejoins: nothing else restarts
    fleet.wait_listed({"w-a1", "w-a2", "w-b"})
    later = {ask(fleet.fronts[i % 2][1], "tiny-a").id for i in range(6)}
    wait_for(lambda: later & set(fleet.done_ids("w-a1")), 10, 0.1, "the restarted worker to take requests")


# Bounded: a stream the drained worker never finished would otherwise wait forever (its SSE
# keepalives reset the client's read timeout); seen once at stop 22 (docs/FLEET.md).
@pytest.mark.timeout(240)
def test_sigterm_drains_a_worker_during_eight_streams_then_it_exits(fleet):
    _, base = fleet.fronts[1]
    tokens = 250
    with ThreadPoolExecutor(8) as pool:  # opened at once: all eight run when the signal lands
        streams = list(pool.map(lambda _: long_stream(base, "tiny-b", tokens), range(8)))
    worker = fleet.workers["w-b"]
    worker.proc.send_signal(signal.SIGTERM)
    for _stream_id, chunks in streams:
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
    assert worker.proc.wait(60) == 0
    draining = [e for e in worker.events() if e.get("event") == "ignis.engine.draining"]
    assert draining and draining[0]["running"] == 8, draining  # the signal landed while all eight ran
    drained = [e for e in worker.events() if e.get("event") == "ignis.engine.drained"]
    assert drained and drained[0]["ended"] == 0
    done = [e for e in worker.events() if e.get("event") == "ignis.request.done"]
    ids = {sid for sid, _ in streams}
    assert {e["request_id"] for e in done if e["request_id"] in ids} == ids
    assert all(e["completion_tokens"] == tokens for e in done if e["request_id"] in ids)
    fleet.wait_listed({"w-a1", "w-a2"}, timeout=10)  # its leaving beat took it out at once
