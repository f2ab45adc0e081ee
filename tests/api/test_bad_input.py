"""Bad input the fuzzer found, refused with the 400 envelope by the one body parser, never a 500.
Django's test client (CSRF enforced, as a browser-less client meets it) for the views,
Channels' communicators for the consumers; no engine: the switch gate is stubbed."""

from __future__ import annotations

import asyncio
import json

import pytest
from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.test import Client

from apps.api import consumer as consumers
from apps.api import parsers
from apps.api.chat.consumer import ChatCompletionsConsumer
from apps.api.completions.consumer import CompletionsConsumer
from apps.api.decide.consumer import DecideConsumer
from apps.api.responses import socket as responses_ws
from apps.api.responses.consumer import ResponsesConsumer
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
    "/v1/chat/completions": (ChatCompletionsConsumer, '{"messages": [{"role": "user", "content": %s}]}'),
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


# -- 20: a NUL byte in a path ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models/switch", "/v1/catalog/import"])
def test_nul_in_a_path_is_400_invalid_path(http, path):
    resp = http.post(path, data='{"path": "\\u0000"}', content_type="application/json")
    assert_openai_error(resp, 400, code="invalid_path", param="path")
    resp = http.post(path, data='{"path": "smollm2/\\u0000.gguf"}', content_type="application/json")
    assert_openai_error(resp, 400, code="invalid_path", param="path")


# -- 21: a role that is not a string (Responses, HTTP and the WebSocket) --------------------------------------------

BAD_ROLES = [["user"], {"a": 1}, 7, None]


@pytest.mark.parametrize("role", BAD_ROLES, ids=["list", "object", "number", "null"])
def test_responses_role_that_is_not_a_string_is_400(offline, role):
    raw = json.dumps({"input": [{"role": role, "content": "hi"}]})
    status, body = asyncio.run(_post(ResponsesConsumer, "/v1/responses", raw))
    assert_openai_error(Answer(status, body), 400, "invalid_type", "input[0].role")


def test_responses_socket_role_that_is_not_a_string_is_an_error_event(offline):
    event = asyncio.run(_socket_error(json.dumps({"type": "response.create", "input": [{"role": ["user"]}]})))
    assert event["type"] == "error" and event["error"]["param"] == "input[0].role", event


# -- 22: PATCH /v1/config refuses wrong JSON types, naming the key --------------------------------------------------


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"server.api_keys": ["sk-a", "sk-b"]}, "server.api_keys"),
        ({"server.api_keys": {"a": "sk-a"}}, "server.api_keys"),
        ({"server.api_keys": 12345}, "server.api_keys"),
        ({"model.id": None}, "model.id"),
        ({"model.prefill_chunk": [512]}, "model.prefill_chunk"),
        ({"switch.allow_implicit": {"on": True}}, "switch.allow_implicit"),
        ({"server.deadline": 30, "switch.known_models": ["a", "b"]}, "switch.known_models"),
    ],
)
def test_config_patch_of_the_wrong_type_is_400_naming_the_key(http, patch, key):
    from django.conf import settings

    before = dict(settings.IGNIS)
    resp = http.patch("/v1/config", data=json.dumps(patch), content_type="application/json")
    err = assert_openai_error(resp, 400, param=key)
    assert key in err["message"]
    assert settings.IGNIS == before


def test_config_still_takes_numbers_and_booleans_as_strings():
    from ignis_site import config

    assert config.validate({"server.api_keys": "sk-a,sk-b", "model.decode_share": "0.5"}) == {
        "server.api_keys": "sk-a,sk-b",
        "model.decode_share": 0.5,
    }


# -- 25: switch targets are bounded where they are taken, and cut where they are echoed ----------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/models/switch", {"path": "m/" + "x" * 1_000_000}, "path"),
        ("/v1/models/switch", {"model": "x" * 1000}, "model"),
        ("/v1/models/switch", {"path": "smollm2-135m-instruct", "model": "x" * 1000}, "model"),
        ("/v1/catalog/import", {"path": "x" * 5000}, "path"),
        ("/v1/catalog/import", {"path": "smollm2-135m-instruct", "id": "x" * 1000}, "id"),
        ("/v1/catalog/download", {"id": "x" * 1000}, "id"),
    ],
)
def test_overlong_switch_target_is_400(http, path, body, param):
    resp = http.post(path, data=json.dumps(body), content_type="application/json")
    err = assert_openai_error(resp, 400, param=param)
    assert len(resp.content) < 1000, err


def test_an_overlong_model_name_on_a_request_is_400():
    from apps.models.services import model_name_resolve

    with pytest.raises(parsers.InvalidRequest) as exc:
        model_name_resolve("x" * 100_000)
    assert exc.value.param == "model" and len(exc.value.message) < 200


def test_engine_status_cuts_what_it_echoes(monkeypatch):
    from channels.layers import get_channel_layer

    from apps.core import engine_client
    from engine.messages import ENGINE_CHANNEL

    huge = "m/" + "x" * 1_000_000
    switch = {"switch_id": "switch-1", "from": "a", "to": huge, "outcome": "refused", "reason": f"no file at {huge}"}

    async def main():
        layer = get_channel_layer()

        async def engine():
            msg = await layer.receive(ENGINE_CHANNEL)
            await layer.send(
                msg["reply_channel"],
                {
                    "type": "engine.status",
                    "status": "serving",
                    "model": "a",
                    "path": "/models/a.gguf",
                    "error": huge,
                    "switching": {"from": "a", "to": huge},
                    "last_switch": switch,
                    "recent_switches": [switch] * 8,
                },
            )

        task = asyncio.ensure_future(engine())
        status = await engine_client.engine_status()
        await task
        return status

    status = asyncio.run(main())
    payload = json.dumps(engine_client.engine_status_payload(status))
    assert len(payload) < 24 * engine_client.ECHO_CHARS, len(payload)  # 20 cut strings, not 18 MB
    assert status.last_switch["switch_id"] == "switch-1" and status.last_switch["to"].startswith("m/xxx")
    assert status.path == "/models/a.gguf" and status.model == "a"
