"""The /v1/decisions consumer on scripted engine replies: the first question's request goes alone,
the rest once it has finished; answers come back in question order whatever order the engine
finishes in; an engine refusal is the request's error. No engine: its messages are sent by the test."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from channels.layers import get_channel_layer
from channels.testing import ApplicationCommunicator

from apps.api import consumer as consumers
from apps.api.decisions.consumer import DecisionsConsumer
from apps.core import engine_client

BODY = {
    "input": "Paris is the capital of France.",
    "questions": [
        {"type": "choice", "name": "a", "instructions": "Capital?", "choices": [{"value": "Paris"}, {"value": "Rome"}]},
        {"type": "predicate", "name": "b", "instructions": "It is about France."},
        {"type": "score", "name": "c", "instructions": "How long?", "levels": [{"label": "short"}, {"label": "long"}]},
    ],
}


@pytest.fixture
def offline(monkeypatch, default_gguf_path):
    sent = []

    async def nothing(**kw):
        return None

    async def submit(add):
        sent.append(add)

    async def abort(request_id):
        sent.append(("abort", request_id))

    monkeypatch.setattr(consumers, "switch_gate", nothing)
    monkeypatch.setattr(consumers, "model_hold", nothing)
    monkeypatch.setattr(engine_client, "request_submit", submit)
    monkeypatch.setattr(engine_client, "request_abort", abort)
    return sent


async def _until(cond, what: str):
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _finished(add, cached: int) -> dict:
    # Every option token gets some mass, the refusal leads next to none.
    from apps.api.decisions.prompt import question_prompt
    from apps.models.services import served_model

    i = int(add.request_id.rsplit("-", 1)[1])
    refusal = set(question_prompt(served_model().tokenizer, BODY["questions"][i], i).refusal_tokens)
    lps = [math.log(1e-4 if t in refusal else 0.05) for t in add.decide_token_ids]
    return {
        "type": "engine.finished",
        "request_id": add.request_id,
        "finish_reason": "stop",
        "prompt_tokens": len(add.prompt_token_ids),
        "completion_tokens": 0,
        "cached_tokens": cached,
        "decide_logprobs": lps,
    }


def _app() -> ApplicationCommunicator:
    return ApplicationCommunicator(
        DecisionsConsumer.as_asgi(), {"type": "http", "method": "POST", "path": "/v1/decisions", "headers": []}
    )


async def _answer(sent: list) -> tuple[dict, int]:
    app, layer = _app(), get_channel_layer()
    await app.send_input({"type": "http.request", "body": json.dumps(BODY).encode()})
    await _until(lambda: sent, "the first question's request")
    await asyncio.sleep(0.1)
    assert len(sent) == 1, "only the first question goes before the input is computed"
    first = sent[0]
    await layer.send(first.reply_channel, _finished(first, cached=0))
    await _until(lambda: len(sent) == 3, "the other questions' requests")
    for add in reversed(sent[1:]):  # the engine may finish them in any order
        await layer.send(add.reply_channel, _finished(add, cached=32))
    start = await app.receive_output(30)
    body = json.loads((await app.receive_output(30))["body"])
    return body | {"_status": start["status"], "_prompts": [len(a.prompt_token_ids) for a in sent]}, first


def test_first_alone_then_the_rest_and_answers_in_order(offline):
    d, first = asyncio.run(_answer(offline))
    assert d["_status"] == 200
    assert [a["name"] for a in d["answers"]] == ["a", "b", "c"]
    assert [a["type"] for a in d["answers"]] == ["choice", "predicate", "score"]
    assert [a.request_id for a in offline] == [f"{d['id']}-{i}" for i in range(3)]
    assert all(add.decide and add.max_tokens == 0 for add in offline)
    assert d["usage"]["input_tokens"] == sum(d["_prompts"])
    assert d["usage"]["input_tokens_details"]["cached_tokens"] == 64


def test_an_engine_refusal_is_the_error_and_aborts_the_rest(offline):
    async def go():
        app, layer = _app(), get_channel_layer()
        await app.send_input({"type": "http.request", "body": json.dumps(BODY).encode()})
        await _until(lambda: offline, "the first request")
        await layer.send(offline[0].reply_channel, _finished(offline[0], cached=0))
        await _until(lambda: len(offline) == 3, "the other questions' requests")
        failed = {
            "type": "engine.failed",
            "request_id": offline[1].request_id,
            "message": "too long",
            "code": "context_length_exceeded",
            "status": 400,
            "error_type": "invalid_request_error",
            "param": "messages",
        }
        await layer.send(offline[1].reply_channel, failed)
        start = await app.receive_output(30)
        return start["status"], json.loads((await app.receive_output(30))["body"])

    status, body = asyncio.run(go())
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "input"
    assert ("abort", offline[2].request_id) in offline
