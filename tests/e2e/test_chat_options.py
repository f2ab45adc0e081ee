"""Chat completions' options through the official openai client, against the live server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import engine_stats
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_stream_helper_accumulates_what_a_plain_request_returns(client):
    kw = {"model": MODEL, "messages": user("Name a fruit."), "max_tokens": 12, "temperature": 0}
    deltas = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    plain = client.chat.completions.create(**kw)
    assert len(deltas) > 3  # one token at a time
    assert final.choices[0].message.content == "".join(deltas) == plain.choices[0].message.content
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason


def test_n_choices_with_a_seed(client):
    ask = dict(model=MODEL, messages=user("Write a word."), max_completion_tokens=6, n=3, seed=7, temperature=1.0)
    resp = client.chat.completions.create(**ask)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens <= 18 and resp.usage.completion_tokens >= 3
    # Repeats from the same retained state (the first call computed the prompt cold; from here on
    # every choice claims its retained prefix) are exact: docs/API.md, "n".
    again = client.chat.completions.create(**ask)
    third = client.chat.completions.create(**ask)
    assert [c.message.content for c in third.choices] == [c.message.content for c in again.choices]


def test_n_choices_streamed_each_with_its_own_index(client):
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=user("Say hello."), max_tokens=5, n=2, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert set(texts) == {0, 1} and texts[0] == texts[1] and texts[0]  # greedy: the same twice
    assert set(finishes) == {0, 1}


def test_logprobs_with_top_alternatives(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=user("What is 2+2?"), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    items = choice.logprobs.content
    assert len(items) == resp.usage.completion_tokens - (choice.finish_reason == "stop")
    assert "".join(i.token for i in items) == choice.message.content
    for it in items:
        assert it.logprob <= 0 and len(it.top_logprobs) == 3
        assert it.top_logprobs[0].token == it.token  # greedy: the chosen token is the likeliest
        assert bytes(it.bytes).decode() == it.token


def test_logprobs_streamed(client):
    tokens, content = [], ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=user("Hi!"), max_tokens=6, temperature=0, logprobs=True, stream=True
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                tokens += [i.token for i in c.logprobs.content]
    assert "".join(tokens) == content and tokens


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    resp = client.chat.completions.create(
        model=MODEL,
        messages=user("Describe a person named Alice who is 30 years old as JSON."),
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )
    value = json.loads(resp.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert resp.choices[0].finish_reason == "stop"


def test_json_schema_streamed_and_json_object_mode(client):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
        "additionalProperties": False,
    }
    text = ""
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=user("Pick a color."),
        max_tokens=30,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
    jsonschema.validate(json.loads(text), schema)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=user("Give me a JSON object with a color."),
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = resp.choices[0].message.content
    assert text.startswith("{")
    if resp.choices[0].finish_reason == "stop":  # a long string value may run past the cap; then it is cut
        assert isinstance(json.loads(text), dict)


def test_required_tool_call_streams_as_tool_call_deltas(client):
    kw = {
        "model": MODEL,
        "messages": user("What is the weather in Paris?"),
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    chunks = []
    with client.chat.completions.stream(**kw) as stream:  # the SDK's helper assembles the call from the deltas
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        final = stream.get_final_completion()
    call_deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert call_deltas[0].id.startswith("call_") and call_deltas[0].function.name in ("get_weather", "get_time")
    assert all(tc.index == 0 for tc in call_deltas)
    assert len(call_deltas) > 2  # name, then the arguments as their tokens arrive
    args = "".join(tc.function.arguments or "" for tc in call_deltas)
    assert isinstance(json.loads(args), dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == call_deltas[0].function.name and json.loads(call.function.arguments) == json.loads(
        args
    )


def test_named_tool_choice_and_a_tool_result_turn(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=user("Weather in Rome?"),
        max_tokens=60,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    follow = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        tools=[WEATHER],
        messages=user("Weather in Rome?")
        + [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "22 C and sunny"},
        ],
    )
    assert follow.choices[0].message.content


def test_tool_choice_none_leaves_text_alone(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=user("Say hi."), max_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content


def test_stop_string_cuts_the_text(client):
    full = (
        client.chat.completions.create(model=MODEL, messages=user("Count from 1 to 10."), max_tokens=24, temperature=0)
        .choices[0]
        .message.content
    )
    digit = next(ch for ch in full if ch.isdigit() and full.index(ch) > 0)
    resp = client.chat.completions.create(
        model=MODEL, messages=user("Count from 1 to 10."), max_tokens=24, temperature=0, stop=[digit]
    )
    assert resp.choices[0].message.content == full[: full.index(digit)]
    assert resp.choices[0].finish_reason == "stop"


def test_deadline_answers_with_what_it_has(client, live_server_url):
    """Cut at the deadline: the output so far, finish_reason "deadline", the sequence aborted in the
    engine (docs/API.md, Deadlines). Stories of up to 4000 tokens outlast a 4 s deadline by far, so
    the cut is what ends them; a finish_reason other than "deadline" fails here rather than passing."""
    idle = wait_for(
        lambda: engine_stats(live_server_url), 30, 0.05, "no lane busy before", until=lambda s: s.get("lanes_busy") == 0
    )
    aborted = idle["aborted"]
    resp = client.chat.completions.create(
        model=MODEL,
        messages=user("Write a long story about a dragon."),
        max_tokens=4000,
        temperature=0,
        extra_body={"deadline": 4},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "deadline", f"not cut: {choice.finish_reason} after {resp.usage}"
    assert resp.usage.completion_tokens < 4000
    assert (choice.message.content or "") == "" if resp.usage.completion_tokens == 0 else choice.message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=user("Write a long story about a cat."),
            max_tokens=4000,
            temperature=0,
            stream=True,
            extra_body={"deadline": 4},
        )
    )
    assert chunks[-1].choices[0].finish_reason == "deadline"
    assert all(ch.finish_reason is None for c in chunks[:-1] for ch in c.choices)
    wait_for(
        lambda: engine_stats(live_server_url),
        10,
        0.05,
        "both cut sequences to be aborted and their lanes freed",
        until=lambda s: s.get("aborted") == aborted + 2 and s.get("lanes_busy") == 0,
    )


@pytest.mark.parametrize(
    "kw,exc,param",
    [
        ({"n": 9}, openai.BadRequestError, "n"),
        ({"logprobs": True, "top_logprobs": 21}, openai.BadRequestError, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop"),
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            openai.BadRequestError,
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"deadline": 1e9}}, openai.BadRequestError, "deadline"),
        ({"max_tokens": 10**6}, openai.BadRequestError, "max_tokens"),
    ],
)
def test_errors_map_to_the_sdk_exception_classes(client, kw, exc, param):
    kw = {"model": MODEL, "messages": user("hi"), "max_tokens": 2, **kw}
    with pytest.raises(exc) as info:
        client.chat.completions.create(**kw)
    assert info.value.body["param"] == param


def test_body_over_the_limit_is_413(client, live_server_url):
    resp = httpx.post(
        live_server_url + "/v1/chat/completions",
        content=b" " * (5 << 20),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=user("x" * (5 << 20)), max_tokens=1)
    assert info.value.status_code == 413
