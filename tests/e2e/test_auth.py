"""API keys on the live server: set through PATCH /v1/config, then the official client's errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.e2e
KEY = "sk-ignis-test-123"


@pytest.fixture
def keyed(live_server_url):
    r = httpx.patch(live_server_url + "/v1/config", json={"server.api_keys": KEY + ",sk-other"}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        yield live_server_url
    finally:
        r = httpx.patch(
            live_server_url + "/v1/config",
            json={"server.api_keys": ""},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text


def test_keys_are_required_once_configured(keyed):
    with_key = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(keyed + "/health", headers=with_key).json()["engine"]["stats"]["admitted"]
    wrong = OpenAI(base_url=keyed + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.body["type"] == "authentication_error" and info.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="smollm2-135m-instruct", prompt="x", max_tokens=1)
    assert httpx.post(keyed + "/v1/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(keyed + "/health").json() == {"status": "ok"}  # health stays open, without the details
    assert httpx.get(keyed + "/health", headers=with_key).json()["engine"]["stats"]["admitted"] == before

    right = OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0)
    resp = right.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert resp.choices[0].message.content is not None
