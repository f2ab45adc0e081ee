"""POST /v1/completions (legacy) through the official client, and /v1/tokenize's exactness."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"


def test_text_completion(client):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert resp.object == "text_completion" and "Paris" in resp.choices[0].text
    assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"


def test_echo_with_logprobs(client):
    prompt = "The capital of France is"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = choice0 = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice0.logprobs
    n_prompt = resp.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and "".join(lp.tokens) == choice.text
    # The prompt is scored too (AddRequest.prompt_logprobs), all but its first token, as in OpenAI's API.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 and max(t.values()) <= 0 for t in lp.top_logprobs[1:])
    assert min(lp.token_logprobs[1:n_prompt]) < -1  # real scores ("capital" after "The" is no sure thing)
    for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert v <= max(top.values()) + 1e-6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_only_never_reaches_the_engine(client):
    resp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert resp.choices[0].text == "Hello there" and resp.usage.completion_tokens == 0


def test_streamed_with_usage_and_several_prompts(client):
    text, usage = {}, None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=["One, two,", "A, B,"],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
    assert set(text) == {0, 1} and all(text.values())
    assert usage.completion_tokens == 8


def test_token_id_prompt_matches_text_prompt(client, live_server_url):
    ids = httpx.post(live_server_url + "/v1/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)


def test_bad_legacy_bodies(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[1, 2], "x"], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)  # nothing to do without echo


def test_tokenize_counts_exactly_what_chat_serves(client, live_server_url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count me exactly."}], **extra}
        counted = httpx.post(live_server_url + "/v1/tokenize", json=body).json()["count"]
        served = client.chat.completions.create(max_tokens=1, **body).usage.prompt_tokens
        assert counted == served
    bad = httpx.post(live_server_url + "/v1/tokenize", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400


def test_detokenize_round_trips(live_server_url):
    ids = httpx.post(live_server_url + "/v1/tokenize", json={"prompt": "Hello, world!"}).json()["tokens"]
    text = httpx.post(live_server_url + "/v1/detokenize", json={"tokens": ids}).json()["text"]
    assert text == "Hello, world!"
