"""What the fuzzer found (issue 11: unknown routes, lone surrogates, deep nesting, NUL paths, odd roles,
config types, unbounded switch targets), on the live server: each a 4xx envelope, and the server
keeps serving. The official client where it has a method for the route, httpx for raw bodies."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from websockets.sync.client import connect as ws_connect

from tests.helpers import assert_openai_error

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
SURROGATE = '"\\ud800"'
DEEP = "[" * 10_000 + "]" * 10_000


def post_raw(base: str, path: str, raw: str, method: str = "POST") -> httpx.Response:
    return httpx.request(
        method, base + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=60
    )


# -- unknown routes and GET /v1/models/{id} --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/moderations", "/v1/images/generations", "/v1/audio/speech"])
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "GET"])
def test_unknown_routes_are_a_json_404(live_server_url, path, method):
    assert_openai_error(post_raw(live_server_url, path, "{}", method), 404, code="not_found")


def test_sdk_sees_not_found_for_unknown_routes(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError):
        client.moderations.create(input="hi")


def test_sdk_models_retrieve(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    assert model.model_extra["status"] in ("serving", "unloaded")
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-9")
    assert exc.value.body["code"] == "model_not_found"


# -- a lone surrogate, deep nesting: one parser for every route --------------------------------------------------

SURROGATE_BODIES = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}'),
    ("/v1/responses", '{"input": %s, "max_output_tokens": 2}'),
    ("/v1/tokenize", '{"messages": [{"role": "user", "content": %s}]}'),
    ("/v1/decide", '{"evidence": %s, "question": "q?", "labels": ["yes", "no"]}'),
    ("/v1/models/switch", '{"model": %s}'),
    ("/v1/catalog/import", '{"path": %s}'),
    ("/v1/catalog/download", '{"id": %s}'),
]


@pytest.mark.parametrize("path, template", SURROGATE_BODIES, ids=[p for p, _ in SURROGATE_BODIES])
def test_lone_surrogate_is_400(live_server_url, path, template):
    err = assert_openai_error(post_raw(live_server_url, path, template % SURROGATE), 400, code="invalid_unicode")
    assert err["param"]


def test_lone_surrogate_on_the_websocket_is_an_error_event(live_server_url):
    with ws_connect(live_server_url.replace("http", "ws") + "/v1/responses") as ws:
        ws.send('{"type": "response.create", "input": ' + SURROGATE + "}")
        event = json.loads(ws.recv(timeout=30))
        assert event["type"] == "error" and event["error"]["code"] == "invalid_unicode", event
        ws.send(json.dumps({"type": "response.create", "input": [{"role": ["user"], "content": "hi"}]}))
        event = json.loads(ws.recv(timeout=30))
        assert event["type"] == "error" and event["error"]["param"] == "input[0].role", event


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/tokenize"),
        ("POST", "/v1/detokenize"),
        ("POST", "/v1/models/switch"),
        ("PATCH", "/v1/config"),
        ("POST", "/v1/catalog/import"),
        ("POST", "/v1/catalog/download"),
        ("POST", "/v1/chat/completions"),
    ],
)
def test_deep_nesting_is_400(live_server_url, method, path):
    assert_openai_error(post_raw(live_server_url, path, DEEP, method), 400, code="invalid_json")


# -- NUL in a path, a role that is not a string, config types, bounded switch targets ---------------------------


@pytest.mark.parametrize("path", ["/v1/models/switch", "/v1/catalog/import"])
def test_nul_in_a_path_is_400(live_server_url, path):
    assert_openai_error(post_raw(live_server_url, path, '{"path": "\\u0000"}'), 400, code="invalid_path", param="path")


@pytest.mark.parametrize("role", [["user"], {"r": "user"}, 3])
def test_responses_role_not_a_string_is_400(client, role):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input=[{"role": role, "content": "hi"}], max_output_tokens=2)
    assert exc.value.body["param"] == "input[0].role"


def test_config_refuses_a_list_for_a_string_key(live_server_url):
    before = httpx.get(live_server_url + "/v1/config", timeout=30).json()["values"]
    resp = httpx.patch(live_server_url + "/v1/config", json={"server.api_keys": ["sk-a", "sk-b"]}, timeout=30)
    assert_openai_error(resp, 400, code="invalid_value", param="server.api_keys")
    assert httpx.get(live_server_url + "/v1/config", timeout=30).json()["values"] == before
    assert httpx.get(live_server_url + "/v1/models", timeout=30).status_code == 200  # no key locks anyone out


def test_overlong_switch_targets_are_refused_and_health_stays_small(live_server_url):
    for body, param in (({"path": "m/" + "x" * 1_000_000}, "path"), ({"model": "x" * 5000}, "model")):
        for _ in range(8):
            resp = httpx.post(live_server_url + "/v1/models/switch", json=body, timeout=60)
            err = assert_openai_error(resp, 400, param=param)
            assert len(err["message"]) < 200
    assert len(httpx.get(live_server_url + "/health", timeout=30).content) < 64 * 1024
    assert len(httpx.get(live_server_url + "/v1/models", timeout=30).content) < 64 * 1024


def test_still_serving(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert resp.choices[0].message.content
