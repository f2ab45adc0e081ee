"""A take-back as clients see it, on scripted engine messages (no engine): the marker chunk between the
reasoning and the answer, the official client's models reading it, usage, the Responses marker event
through the SDK's accumulator, and the reasoning watch each request hands the engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from channels.layers import get_channel_layer
from channels.testing import ApplicationCommunicator
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from apps.api.chat.consumer import ChatCompletionsConsumer
from apps.api.responses.events import ResponseEvents
from apps.api.thinking import EFFORT_BUDGET, reasoning_budget
from apps.api.usage import usage_object
from tests.api.test_chat_consumer import tokenizer  # noqa: F401 - fixtures (offline: tests/api/conftest.py)
from tests.api.test_responses_events import base, through_sdk

LOOP = "<think>I think, I think, I think"
ANSWER = "Four."


async def _run(body: dict, submitted: list, tok, *, taken_back: int = 3) -> tuple[list[dict], object]:
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
    layer = get_channel_layer()
    rounds = [{"token_ids": tok.encode(LOOP)}]
    rounds.append({"token_ids": add.reasoning["close_ids"], "taken_back": taken_back, "taken_back_reason": "loop"})
    rounds.append({"token_ids": tok.encode(ANSWER)})
    n = 0
    for r in rounds:
        n += len(r["token_ids"])
        await layer.send(add.reply_channel, {"type": "engine.tokens", "request_id": add.request_id, **r})
    done = {"type": "engine.finished", "request_id": add.request_id, "finish_reason": "stop",
            "prompt_tokens": len(add.prompt_token_ids), "completion_tokens": n + 1, "taken_back_tokens": taken_back}  # fmt: skip
    await layer.send(add.reply_channel, done)
    assert (await app.receive_output(30))["status"] == 200
    raw = b""
    while True:
        msg = await app.receive_output(30)
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if not body.get("stream"):
        return [json.loads(raw)], add
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]], add


def test_the_marker_streams_between_the_reasoning_and_the_answer(offline, tokenizer):  # noqa: F811
    body = {
        "messages": [{"role": "user", "content": "2+2?"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, add = asyncio.run(_run(body, offline, tokenizer))
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]  # the official client's model
    order = []
    for c in parsed:
        if not c.choices:
            continue
        extra = c.choices[0].delta.model_extra or {}
        order += ["reasoning"] * bool(extra.get("reasoning_content")) + ["content"] * bool(c.choices[0].delta.content)
        if extra.get("taken_back"):
            assert extra["taken_back"] == {"tokens": 3, "reason": "loop"}
            order.append("marker")
    i = order.index("marker")
    assert set(order[:i]) == {"reasoning"} and set(order[i + 1 :]) == {"content"}
    text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
    assert text == ANSWER  # the forced </think> closed the channel; no tag leaks into the answer
    usage = parsed[-1].usage
    assert usage.completion_tokens_details.model_extra["taken_back_tokens"] == 3
    assert usage.completion_tokens == len(tokenizer.encode(LOOP)) + len(add.reasoning["close_ids"]) + 3
    # The reasoning the model wrote, after its opening tag; the forced close is not counted.
    assert usage.completion_tokens_details.reasoning_tokens == len(tokenizer.encode(LOOP)) - len(
        tokenizer.encode("<think>")
    )


def test_the_whole_message_lists_its_take_backs(offline, tokenizer):  # noqa: F811
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_reasoning_tokens": 7}
    (resp,), add = asyncio.run(_run(body, offline, tokenizer))
    msg = ChatCompletion.model_validate(resp).choices[0].message
    assert msg.content == ANSWER and msg.model_extra["reasoning_content"] == "I think, I think, I think"
    assert msg.model_extra["taken_back"] == [{"tokens": 3, "reason": "loop"}]
    assert add.reasoning["max_tokens"] == 7 and add.reasoning["open"] is False
    assert tokenizer.decode(add.reasoning["close_ids"]) == "</think>\n\n"
    assert tokenizer.encode("</think>") in add.reasoning["end_ids"]
    assert tokenizer.encode("<think>") in add.reasoning["start_ids"]


def test_efforts_map_to_budgets():
    assert [reasoning_budget(None, e) for e in ("none", "minimal", "low", "medium", "high", "xhigh")] == [
        0, 0, 1024, 4096, 16384, None,
    ]  # fmt: skip
    assert reasoning_budget(5, "high") == 5 and reasoning_budget(None, None) is None
    assert set(EFFORT_BUDGET) == {"none", "minimal", "low", "medium", "high", "xhigh"}


@pytest.mark.parametrize("value", [-1, 1.5, "10", True])
def test_a_bad_budget_is_refused_naming_it(value):
    from apps.api.validation import parse_chat_request
    from apps.core.errors import IgnisError

    with pytest.raises(IgnisError) as err:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "max_reasoning_tokens": value})
    assert err.value.param == "max_reasoning_tokens" and err.value.status == 400


def test_the_responses_marker_goes_through_the_sdk():
    ev = ResponseEvents(base(), tools=False)
    events = ev.start()
    for piece in ("<think>I", " think,", " I think"):
        events += ev.feed(piece, 1)
    events += ev.take_back({"tokens": 2, "reason": "loop"})
    for piece in ("</think>\n\n", "Four."):
        events += ev.feed(piece, 1)
    ev.taken_back_tokens = 2
    events += ev.finish(usage_object(10, 6, 0))
    marker = [e for e in events if "taken_back" in e]
    assert len(marker) == 1 and marker[0]["type"] == "response.reasoning_text.delta" and marker[0]["delta"] == ""
    final = through_sdk(events)[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].model_extra["taken_back"] == [{"tokens": 2, "reason": "loop"}]
    assert final.output_text == "Four."
    assert final.usage.output_tokens_details.model_extra["taken_back_tokens"] == 2
