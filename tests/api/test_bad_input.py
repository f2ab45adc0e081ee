"""Bad input the fuzzer found, refused with the 400 envelope by the one body parser, never a 500.
Django's test client (CSRF enforced, as a browser-less client meets it) for the views,
Channels' communicators for the consumers; no engine: the switch gate is stubbed."""

from __future__ import annotations

import asyncio
import json

import pytest
from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.test import Client

from apps.api import consumers, parsers, responses_ws
from apps.api.completions import CompletionsConsumer
from apps.api.decide import DecideConsumer
from apps.api.responses_http import ResponsesConsumer
from apps.models import middleware
from tests.helpers import assert_openai_error

SURROGATE = '"\\ud800"'  # JSON text for a lone surrogate, as the fuzzer sent it
DEEP = "[" * 10_000 + "]" * 10_000


@pytest.fixture
def http(monkeypatch):
    async def nothing(**kw):
        return None

    monkeypatch.setattr(middleware, "switch_gate", nothing)
    return Client(enforce_csrf_checks=True)


@pytest.fixture
def offline(monkeypatch):
    async def nothing(**kw):
        return None

    for module in (consumers, responses_ws):
        monkeypatch.setattr(module, "switch_gate", nothing)
        monkeypatch.setattr(module, "model_hold", nothing)


# -- 18, 19: lone surrogates and deep nesting on the DRF views ---------------------------------------------------

DRF_BODIES = {
    "/v1/tokenize": '{"messages": [{"role": "user", "content": %s}]}',
    "/v1/detokenize": '{"tokens": [1], "x": %s}',
    "/v1/models/switch": '{"model": %s}',
    "/v1/catalog/import": '{"path": %s}',
    "/v1/catalog/download": '{"id": %s}',
}


@pytest.mark.parametrize("path", list(DRF_BODIES))
def test_lone_surrogate_is_400_naming_the_field(http, path):
    resp = http.post(path, data=DRF_BODIES[path] % SURROGATE, content_type="application/json")
    err = assert_openai_error(resp, 400, code="invalid_unicode")
    assert err["param"] in ("messages[0].content", "x", "model", "path", "id")


def test_lone_surrogate_in_a_key_and_in_config_patch(http):
    resp = http.patch(
        "/v1/config", data='{"server.api_keys": "a", ' + SURROGATE + ": 1}", content_type="application/json"
    )
    assert_openai_error(resp, 400, code="invalid_unicode")


@pytest.mark.parametrize("path", list(DRF_BODIES))
def test_deep_nesting_is_400(http, path):
    assert_openai_error(http.post(path, data=DEEP, content_type="application/json"), 400, code="invalid_json")


def test_deep_nesting_on_config_patch_is_400(http):
    body = '{"server.deadline": ' + DEEP + "}"
    assert_openai_error(http.patch("/v1/config", data=body, content_type="application/json"), 400, code="invalid_json")


def test_valid_astral_pairs_and_shallow_nesting_pass():
    assert parsers.json_loads('{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}
    nested = "[" * parsers.MAX_DEPTH + "]" * parsers.MAX_DEPTH
    assert parsers.json_loads(nested) is not None
    with pytest.raises(parsers.InvalidRequest):
        parsers.json_loads("[" + nested + "]")


# -- 18, 19 on the consumers (chat, completions, responses, decide) and the Responses WebSocket ---------------

CONSUMERS = {
    "/v1/chat/completions": (consumers.ChatCompletionsConsumer, '{"messages": [{"role": "user", "content": %s}]}'),
    "/v1/completions": (CompletionsConsumer, '{"prompt": %s}'),
    "/v1/responses": (
        ResponsesConsumer,
        '{"input": [{"role": "user", "content": [{"type": "input_text", "text": %s}]}]}',
    ),
    "/v1/decide": (DecideConsumer, '{"evidence": "e", "question": %s, "labels": ["a", "b"]}'),
}


async def _post(consumer, path: str, raw: str) -> tuple[int, dict]:
    app = ApplicationCommunicator(consumer.as_asgi(), {"type": "http", "method": "POST", "path": path, "headers": []})
    await app.send_input({"type": "http.request", "body": raw.encode()})
    start = await app.receive_output(10)
    body = await app.receive_output(10)
    await app.wait(5)
    return start["status"], json.loads(body["body"])


class Answer:
    def __init__(self, status: int, body: dict):
        self.status_code, self._body = status, body
        self.headers = {"content-type": "application/json"}
        self.text = json.dumps(body)

    def json(self) -> dict:
        return self._body


@pytest.mark.parametrize("path", list(CONSUMERS))
def test_consumers_refuse_a_lone_surrogate(offline, path):
    consumer, template = CONSUMERS[path]
    err = assert_openai_error(Answer(*asyncio.run(_post(consumer, path, template % SURROGATE))), 400, "invalid_unicode")
    assert err["param"]


@pytest.mark.parametrize("path", list(CONSUMERS))
def test_consumers_refuse_deep_nesting(offline, path):
    consumer, _ = CONSUMERS[path]
    assert_openai_error(Answer(*asyncio.run(_post(consumer, path, DEEP))), 400, "invalid_json")


async def _socket_error(frame: str) -> dict:
    ws = WebsocketCommunicator(responses_ws.ResponsesSocketConsumer.as_asgi(), "/v1/responses")
    connected, _ = await ws.connect()
    assert connected
    await ws.send_to(text_data=frame)
    event = json.loads(await ws.receive_from(10))
    await ws.disconnect()
    return event


def test_websocket_refuses_a_lone_surrogate_and_stays_open(offline):
    event = asyncio.run(_socket_error('{"type": "response.create", "input": ' + SURROGATE + "}"))
    assert event["type"] == "error" and event["error"]["code"] == "invalid_unicode", event
    assert event["error"]["param"] == "input"
