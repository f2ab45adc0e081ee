"""Bad input gets a 4xx in the OpenAI envelope naming the param; the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import assert_openai_error

pytestmark = pytest.mark.e2e

MSGS = [{"role": "user", "content": "Hi"}]
CASES = [
    ({"messages": "hello"}, "messages"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": -5}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": 10_000_000}, "max_tokens"),
    ({"messages": MSGS, "temperature": -1}, "temperature"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "top_p": 1.5}, "top_p"),
    ({"messages": MSGS, "seed": 1.5}, "seed"),
    ({"messages": MSGS, "stop": [1, 2]}, "stop"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "model": 7}, "model"),
    ({"messages": MSGS, "frequency_penalty": 9}, "frequency_penalty"),
]


@pytest.mark.parametrize("body,param", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_bad_field_is_400_naming_param(live_server_url, body, param):
    resp = httpx.post(live_server_url + "/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(resp, 400, param=param)


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        b'{"messages": NaN}',
        b"\xff\xfe",
        b"",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
    ],
)
def test_malformed_json_is_400(live_server_url, raw):
    resp = httpx.post(
        live_server_url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert_openai_error(resp, 400, code="invalid_json")


def test_body_over_limit_is_413(live_server_url):
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (5 << 20) + b'"}]}'
    resp = httpx.post(live_server_url + "/v1/chat/completions", content=big, timeout=60)
    assert_openai_error(resp, 413, code="request_too_large")


def test_prompt_beyond_context_is_context_length_exceeded(live_server_url):
    long = "hello " * 9000
    resp = httpx.post(
        live_server_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}, timeout=60
    )
    assert_openai_error(resp, 400, code="context_length_exceeded", param="messages")


def test_unknown_model_is_404(live_server_url):
    resp = httpx.post(live_server_url + "/v1/chat/completions", json={"model": "gpt-9", "messages": MSGS})
    assert_openai_error(resp, 404, code="model_not_found", param="model")


def test_wrong_method_and_route(live_server_url):
    assert_openai_error(httpx.get(live_server_url + "/v1/chat/completions"), 405)
    assert_openai_error(httpx.get(live_server_url + "/v1/nothing-here"), 404, code="not_found")


def test_openai_client_maps_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="smollm2-135m-instruct", messages=MSGS, max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)


def test_still_serving_after_bad_input(client):
    resp = client.chat.completions.create(model="smollm2-135m-instruct", messages=MSGS, max_tokens=3)
    assert resp.choices[0].message.content
