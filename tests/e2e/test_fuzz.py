"""Malformed and out-of-range bodies on every route: always a 4xx envelope, never a 5xx; the server still serves.

Bodies start from a valid request and have fields replaced by arbitrary JSON
(hypothesis), so most reach deep into validation; generation stays capped at a
couple of tokens (a fuzzed cap is only ever out of range) to keep it quick.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bot", ""]),
        "content": st.text(max_size=40) | json_values,
    }
)
tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "x"]),
        "function": st.fixed_dictionaries({"name": st.text(max_size=10) | json_values, "parameters": json_values}),
    }
)
CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
bad_cap = (
    st.integers(max_value=0)
    | st.integers(min_value=1 << 31)
    | st.text(max_size=5)
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
)
FIELDS = {
    "messages": st.lists(message, max_size=3) | json_values,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60000), max_size=5) | json_values,
    "input": st.text(max_size=30) | json_values,
    "model": json_values | st.sampled_from([MODEL, MODEL + "@agent", "nope", "../../etc"]),
    "temperature": json_values,
    "top_p": json_values,
    "top_k": json_values,
    "min_p": json_values,
    "seed": json_values,
    "stop": json_values,
    "n": st.integers(-2, 12) | json_values,
    "stream": json_values,
    "stream_options": json_values,
    "logprobs": json_values,
    "top_logprobs": st.integers(-2, 30) | json_values,
    "presence_penalty": json_values,
    "frequency_penalty": json_values,
    "repetition_penalty": json_values,
    "response_format": json_values
    | st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object"]), "json_schema": json_values}),
    "tools": st.lists(tool, max_size=3) | json_values,
    "tool_choice": json_values | st.sampled_from(["auto", "none", "required"]),
    "parallel_tool_calls": json_values,
    "chat_template_kwargs": json_values,
    "class": json_values,
    "deadline": json_values,
    "echo": json_values,
    "best_of": json_values,
    "suffix": json_values,
    "tokens": st.lists(st.integers(-5, 10**6), max_size=5) | json_values,
    "instructions": json_values,
    "previous_response_id": json_values,
    "evidence": json_values,
    "question": json_values,
    "labels": json_values,
}
BASES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/tokenize": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/detokenize": {"tokens": [1, 2, 3]},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/decide": {
        "model": MODEL,
        "evidence": "The sky is blue.",
        "question": "What color?",
        "labels": ["blue", "red"],
    },
}


@st.composite
def bodies(draw, route: str):
    body = dict(BASES[route])
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[name] = draw(FIELDS[name])
    for cap in CAPS:
        if cap in body or draw(st.booleans()):
            body[cap] = draw(bad_cap) if draw(st.integers(0, 3)) == 0 else 2
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return body


def check(resp: httpx.Response) -> None:
    assert resp.status_code < 500 or resp.json()["error"]["code"] in ("engine_full", "model_switching"), (
        resp.status_code,
        resp.text[:300],
    )
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err


def post(base: str, route: str, **kw) -> httpx.Response:
    with httpx.Client(timeout=60) as http:
        resp = http.post(base + route, **kw)
        resp.read()
        return resp


@pytest.fixture(scope="module")
def routes(live_server_url):
    """The routes this server has (the Responses and decide routes may be absent on a partial checkout)."""
    found = []
    for route in BASES:
        r = post(live_server_url, route, json={})
        if r.status_code != 404 or r.json()["error"]["code"] != "not_found":
            found.append(route)
    assert "/v1/chat/completions" in found and "/v1/completions" in found
    return found


@pytest.mark.parametrize("route", list(BASES))
def test_fuzzed_json_bodies(live_server_url, routes, route):
    if route not in routes:
        pytest.skip(f"{route} is not routed here")

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies(route))
    def run(body):
        check(post(live_server_url, route, json=body))

    run()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    route=st.sampled_from(list(BASES)),
    raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
    ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_garbage_bytes(live_server_url, route, raw, ctype):
    check(post(live_server_url, route, content=raw, headers={"content-type": ctype} if ctype else {}))


def test_wrong_methods_and_unknown_routes(live_server_url):
    for route in BASES:
        check(httpx.get(live_server_url + route, timeout=30))
        check(httpx.delete(live_server_url + route, timeout=30))
    r = httpx.get(live_server_url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_server_still_serves_after_the_fuzz(client, live_server_url):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=20, temperature=0
    )
    assert "4" in resp.choices[0].message.content
    assert httpx.get(live_server_url + "/health").json()["engine"]["stats"]["lanes_busy"] == 0
