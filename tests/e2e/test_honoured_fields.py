"""Fields the server once accepted and ignored (issue 11 point 9), met with the official openai client:
logit_bias, min_tokens and ignore_eos change what is generated, reasoning_effort is refused where
the model has no thinking switch, and ``responses.parse(text_format=...)`` gets JSON that parses."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def eos(default_gguf_path) -> int:
    from engine.tokenizer import load_tokenizer

    return sorted(load_tokenizer(default_gguf_path).eos_token_ids)[0]


def _eos_forced(client, eos: int, **extra):
    """A completion whose every step would pick EOS (+100), unless min_tokens / ignore_eos say otherwise."""
    return client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logit_bias={str(eos): 100}, **extra
    )


def test_logit_bias_forces_a_token(client):
    word = client.post("/tokenize", body={"prompt": " yes"}, cast_to=object)["tokens"][-1]
    resp = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, temperature=0, logit_bias={str(word): 100}
    )
    assert resp.choices[0].message.content.strip() == "yes yes yes"


def test_min_tokens_holds_off_the_stop_token(client, eos):
    assert _eos_forced(client, eos).usage.completion_tokens == 1  # EOS at once
    resp = _eos_forced(client, eos, extra_body={"min_tokens": 4})
    assert (resp.usage.completion_tokens, resp.choices[0].finish_reason) == (5, "stop")


def test_ignore_eos_generates_to_max_tokens(client, eos):
    assert _eos_forced(client, eos).usage.completion_tokens == 1
    resp = _eos_forced(client, eos, extra_body={"ignore_eos": True})
    assert (resp.usage.completion_tokens, resp.choices[0].finish_reason) == (8, "length")


def test_reasoning_effort_without_a_thinking_switch(client):
    ok = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, reasoning_effort="none")
    assert ok.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, reasoning_effort="high")
    assert (exc.value.body["param"], exc.value.body["code"]) == ("reasoning_effort", "unsupported")


class City(BaseModel):
    name: str
    country: str


def test_responses_parse_with_a_pydantic_text_format(client):
    resp = client.responses.parse(
        model=MODEL, input="Name a city in France.", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(resp.output_parsed, City), resp.output_text
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "City"


def test_responses_json_object_format_is_json(client):
    import json

    resp = client.responses.create(
        model=MODEL,
        input="Give a JSON object with a key 'a'.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    assert resp.text.format.type == "json_object"
    if resp.status == "completed":  # a cut output may not parse, as with OpenAI
        assert isinstance(json.loads(resp.output_text), dict)
