"""POST /v1/responses with the official openai client: whole, SSE, continuation, tools, bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import assert_openai_error

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
BLOCK = 16  # model.kv_block_size default


def create(client, input, **kw):
    kw = {"temperature": 0, "max_output_tokens": 24, **kw}
    return client.responses.create(model=MODEL, input=input, **kw)


def test_create_whole(client):
    r = create(client, "What is 2+2?", instructions="Answer briefly.")
    assert r.id.startswith("resp_")
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.instructions == "Answer briefly."
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.output[0].role == "assistant"
    assert "4" in r.output_text
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_input_items_and_stream_helper(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}]
    with client.responses.stream(model=MODEL, input=items, temperature=0, max_output_tokens=16) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
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
        final.status == "completed" and "response.completed" or "response.incomplete",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3
    assert "".join(d.delta for d in deltas) == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(e.item_id == final.output[0].id for e in deltas)


def test_raw_sse_has_event_lines_and_no_done_marker(live_server_url):
    body = {"model": MODEL, "input": "Say hi.", "stream": True, "max_output_tokens": 4, "temperature": 0}
    with httpx.stream("POST", live_server_url + "/v1/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = "".join(resp.iter_text())
    # SSE comment lines (": keepalive", sent while a slow machine computes) are not events.
    blocks = ["\n".join(x for x in b.split("\n") if not x.startswith(":")) for b in text.split("\n\n")]
    blocks = [b for b in blocks if b.strip()]
    assert blocks and "[DONE]" not in text
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")


def test_streamed_equals_whole_greedy(client):
    whole = create(client, "Write one sentence about the sea.", max_output_tokens=12).output_text
    stream = create(client, "Write one sentence about the sea.", max_output_tokens=12, stream=True)
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == whole


def test_max_output_tokens_gives_incomplete(client):
    r = create(client, "Tell me a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_previous_response_id_resumes_from_retained_state(client):
    # Instructions are per request (not carried over), so a client sends them every turn.
    first = create(client, "My name is Ada. Remember it.", instructions="You are terse.", max_output_tokens=12)
    second = create(
        client, "What is my name?", instructions="You are terse.", previous_response_id=first.id, max_output_tokens=12
    )
    assert second.previous_response_id == first.id
    # The conversation came back: the earlier turn and its answer are in this prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 5
    # The earlier prompt's full blocks are claimed from retained state, not prefilled again.
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // BLOCK) * BLOCK > 0
    third = create(
        client, "And again?", instructions="You are terse.", previous_response_id=second.id, max_output_tokens=4
    )
    assert third.usage.input_tokens_details.cached_tokens >= (second.usage.input_tokens // BLOCK) * BLOCK


def test_unknown_previous_response_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        create(client, "hi", previous_response_id="resp_doesnotexist")
    assert exc.value.body["code"] == "previous_response_not_found"
    assert exc.value.body["param"] == "previous_response_id"


def test_store_false_is_not_continuable(client):
    r = create(client, "Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        create(client, "Again", previous_response_id=r.id, max_output_tokens=2)


def test_required_tool_choice_gives_a_function_call(client):
    tools = [
        {
            "type": "function",
            "name": "get_time",
            "description": "The current time.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        }
    ]
    r = create(client, "What time is it?", tools=tools, tool_choice="required", max_output_tokens=40)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_time" and json.loads(call.arguments) == {}
    # The tool's answer goes back as a function_call_output item on the next turn.
    follow = create(
        client,
        [{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
        previous_response_id=r.id,
        tools=tools,
        max_output_tokens=8,
    )
    assert follow.status in ("completed", "incomplete")


MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ({}, "input"),
    ({"input": 42}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10_000_000}, "max_output_tokens"),
    ({"input": "hi", "temperature": 5}, "temperature"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "previous_response_id": 5}, "previous_response_id"),
    ({"input": MSG, "metadata": "x"}, "metadata"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_400_naming_param(live_server_url, body, param):
    resp = httpx.post(live_server_url + "/v1/responses", json=body, timeout=30)
    assert_openai_error(resp, 400, param=param)


def test_malformed_json_is_400(live_server_url):
    resp = httpx.post(
        live_server_url + "/v1/responses", content=b"{nope", headers={"content-type": "application/json"}, timeout=30
    )
    assert_openai_error(resp, 400, code="invalid_json")


def test_retrieve_and_delete_a_stored_response(client):
    r = create(client, "Hi", max_output_tokens=3)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(client, "Again", previous_response_id=r.id, max_output_tokens=2)
