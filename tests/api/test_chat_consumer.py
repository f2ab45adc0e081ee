"""The chat consumer on scripted engine rounds: several tokens a round still stream one token per chunk,
and reasoning / tool calls come out as their own deltas. No engine: its messages are sent by the test."""

from __future__ import annotations

import asyncio
import json

import pytest
from channels.layers import get_channel_layer
from channels.testing import ApplicationCommunicator

from apps.api.chat.consumer import ChatCompletionsConsumer

SCRIPT = (
    "<think>Weather needs a tool.</think>\n\nChecking.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


async def _run(body: dict, rounds_of: int, submitted: list, tokenizer) -> list[dict]:
    app = ApplicationCommunicator(
        ChatCompletionsConsumer.as_asgi(),
        {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []},
    )
    await app.send_input({"type": "http.request", "body": json.dumps(body).encode()})
    for _ in range(400):
        if submitted:
            break
        await asyncio.sleep(0.05)
    add = submitted[0]
    ids = tokenizer.encode(SCRIPT)
    layer = get_channel_layer()
    for i in range(0, len(ids), rounds_of):
        await layer.send(
            add.reply_channel,
            {
                "type": "engine.tokens",
                "request_id": add.request_id,
                "token_ids": ids[i : i + rounds_of],
                "cached_tokens": 0,
            },
        )
    await layer.send(
        add.reply_channel,
        {
            "type": "engine.finished",
            "request_id": add.request_id,
            "finish_reason": "stop",
            "prompt_tokens": len(add.prompt_token_ids),
            "completion_tokens": len(ids) + 1,
        },
    )
    start = await app.receive_output(30)
    assert start["status"] == 200
    body_bytes = b""
    while True:
        msg = await app.receive_output(30)
        body_bytes += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if not body.get("stream"):
        return [json.loads(body_bytes)]
    events = [line[6:] for line in body_bytes.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path):
    from apps.models.services import served_model

    return served_model().tokenizer


@pytest.mark.parametrize("rounds_of", [1, 4, 1000])
def test_stream_splits_channels_one_token_per_chunk(offline, tokenizer, rounds_of):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "stream": True,
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    chunks = asyncio.run(_run(body, rounds_of, offline, tokenizer))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert reasoning == "Weather needs a tool." and content == "Checking."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = [c["function"]["arguments"] for c in calls[1:]]
    assert calls[0]["function"]["arguments"] == "" and "".join(args) == '{"city": "Paris"}'
    if rounds_of == 1:  # the arguments stream as their tokens come, not whole at the close
        assert len(args) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # One chunk per reasoning/content token whatever the round size: the reasoning alone spans several tokens.
    assert sum(1 for d in deltas if d.get("reasoning_content")) == len(tokenizer.encode("Weather needs a tool."))


def test_whole_response_carries_the_channels(offline, tokenizer):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    (resp,) = asyncio.run(_run(body, 5, offline, tokenizer))
    msg = resp["choices"][0]["message"]
    assert msg["reasoning_content"] == "Weather needs a tool." and msg["content"] == "Checking."
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert resp["choices"][0]["finish_reason"] == "tool_calls"
