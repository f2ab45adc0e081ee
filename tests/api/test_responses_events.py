"""Responses API events, checked against the official SDK's own types and stream accumulator.

Scripted generations (reasoning, text, tool calls, cut by max_output_tokens)
are fed to ResponseEvents piece by piece; every event must validate as the
SDK's ResponseStreamEvent, numbered 0, 1, 2 ..., and ResponseStreamState
(what ``client.responses.stream()`` runs) must accept the sequence and end
with the same response we would answer whole.
"""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from apps.api.responses.events import ResponseEvents, output_text
from apps.api.usage import usage_object

EVENT = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]


def base() -> dict:
    return {
        "id": "resp_test",
        "object": "response",
        "created_at": 1,
        "status": "queued",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": "m",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": TOOLS,
        "temperature": 1.0,
        "top_p": 1.0,
        "usage": None,
    }


def run(pieces: list[str], *, tools: bool = True, cut: str | None = None) -> tuple[list[dict], dict]:
    ev = ResponseEvents(base(), tools=tools)
    events = ev.start()
    for p in pieces:
        events += ev.feed(p, 1)
    events += ev.finish(usage_object(10, len(pieces), 4), incomplete_reason=cut)
    return events, ev.response


def through_sdk(events: list[dict]):
    state = ResponseStreamState(input_tools=TOOLS, text_format=omit)
    out = []
    for e in events:
        parsed = EVENT.validate_python(json.loads(json.dumps(e)))
        out += state.handle_event(parsed)
    return out


def chop(text: str, n: int = 3) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def test_plain_text_has_the_sdk_sequence():
    events, response = run(chop("Hello there, friend."))
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    out = through_sdk(events)
    final = out[-1].response
    assert final.output_text == "Hello there, friend." == output_text(response)
    assert final.output[0].id.startswith("msg_")
    assert response["status"] == "completed"
    assert Response.model_validate(response).usage.input_tokens_details.cached_tokens == 4


def test_reasoning_then_text_then_tool_call():
    script = (
        '<think>The user wants weather.</think>\n\nLet me check.<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>'
    )
    events, response = run(chop(script, 4))
    kinds = [i["type"] for i in response["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    rs, msg, fc = response["output"]
    assert rs["id"].startswith("rs_") and rs["content"][0]["text"] == "The user wants weather."
    assert msg["content"][0]["text"] == "Let me check."
    assert fc["id"].startswith("fc_") and fc["call_id"].startswith("call_")
    assert fc["name"] == "get_weather" and json.loads(fc["arguments"]) == {"city": "Paris"}
    types = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    # output_index of each item's events matches its place in output
    for e in events:
        if "output_index" in e and e["type"] == "response.output_item.done":
            assert response["output"][e["output_index"]]["id"] == e["item"]["id"]
    final = through_sdk(events)[-1].response
    assert [o.type for o in final.output] == kinds
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    # The arguments stream as they arrive (several deltas), adding up to the item's arguments.
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == fc["arguments"] == '{"city": "Paris"}'
    added = next(
        e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    )
    assert added["item"]["name"] == "get_weather" and added["item"]["arguments"] == ""


def test_failure_mid_call_closes_the_function_call():
    ev = ResponseEvents(base(), tools=True)
    events = ev.start() + ev.feed('<tool_call>{"name": "get_weather", "arguments": {"ci', 1)
    assert events[-1]["type"] == "response.function_call_arguments.delta"
    events += ev.fail("server_error", "boom")
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    through_sdk(events)


def test_tool_text_without_tools_stays_text():
    script = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    events, response = run(chop(script), tools=False)
    assert [i["type"] for i in response["output"]] == ["message"]
    assert output_text(response) == script
    through_sdk(events)


def test_cut_by_max_output_tokens_is_incomplete():
    events, response = run(chop("Once upon a time"), cut="max_output_tokens")
    assert events[-1]["type"] == "response.incomplete"
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    through_sdk(events)


@pytest.mark.parametrize("cut", [1, 2, 5, 7])
def test_tags_split_anywhere_give_the_same_items(cut):
    script = "<think>hmm</think>Answer: 4."
    events, response = run(chop(script, cut))
    assert [i["type"] for i in response["output"]] == ["reasoning", "message"]
    assert output_text(response) == "Answer: 4."
    through_sdk(events)


def test_failure_mid_stream_closes_the_item():
    ev = ResponseEvents(base(), tools=False)
    events = ev.start() + ev.feed("partial", 1) + ev.fail("server_error", "boom")
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "boom"
    through_sdk(events)
