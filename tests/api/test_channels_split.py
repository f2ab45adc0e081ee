"""The reasoning / content / tool-call splitter on scripted model text, fed in every possible way."""

from __future__ import annotations

import json

import pytest

from apps.api.channels_split import ChannelSplitter, parse_tool_call

QWEN = (
    "<think>\nThe user wants the weather. I'll call get_weather.\n</think>\n\n"
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    "</tool_call>"
)


def run(text: str, pieces: list[str], **kw) -> tuple[ChannelSplitter, list]:
    sp = ChannelSplitter(**kw)
    events = []
    for p in pieces:
        events += sp.feed(p)
    events += sp.flush()
    return sp, events


def chunkings(text: str):
    yield [text]
    yield list(text)  # one character at a time: every tag is split
    yield [text[i : i + 3] for i in range(0, len(text), 3)]
    yield [text[i : i + 7] for i in range(0, len(text), 7)]


@pytest.mark.parametrize("pieces", list(chunkings(QWEN)), ids=["whole", "chars", "3s", "7s"])
def test_qwen_reasoning_content_and_two_calls(pieces):
    sp, events = run(QWEN, pieces)
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [e.call for e in events if e.kind == "tool_call"]
    assert reasoning.strip() == "The user wants the weather. I'll call get_weather."
    assert content == "Let me check.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [c.index for c in calls] == [0, 1]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert "<" not in content  # no half tag leaked


def test_order_of_events_is_reasoning_then_content_then_calls():
    _, events = run(QWEN, list(QWEN))
    kinds = [e.kind for e in events]
    first_content = kinds.index("content")
    assert all(k == "reasoning" for k in kinds[:first_content])
    assert kinds[-2:] == ["tool_call", "tool_call"]


def test_prompt_opened_think():
    sp, events = run(
        "deep thought</think>The answer is 4.", ["deep th", "ought</th", "ink>The answer is 4."], in_reasoning=True
    )
    assert sp.reasoning == "deep thought" and sp.content == "The answer is 4."


def test_tools_off_keeps_tool_text_as_content():
    text = 'x <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    sp, events = run(text, list(text), parse_tools=False)
    assert sp.content == text and not sp.tool_calls


def test_malformed_call_is_shown_as_text():
    text = "<tool_call>not json</tool_call> after"
    sp, _ = run(text, list(text))
    assert not sp.tool_calls
    assert sp.content == "<tool_call>not json</tool_call>after"


def test_unclosed_call_at_the_end_still_counts_when_it_parses():
    sp, events = run(
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', ['<tool_call>\n{"name": "f", ', '"arguments": {"a": 1}}']
    )
    assert [c.name for c in sp.tool_calls] == ["f"]


def test_angle_brackets_that_are_no_tag_pass_through():
    text = "a < b and <thinking> is not <think"
    sp, events = run(text, list(text))
    assert sp.content == text
    # Nothing is held once a piece cannot begin a tag any more.
    sp2 = ChannelSplitter()
    assert "".join(e.text for e in sp2.feed("1 < 2")) == "1 < 2"


def test_parse_tool_call_shapes():
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}', 0).arguments == '{"a": 1}'
    assert parse_tool_call('{"name": "f", "parameters": {"a": 1}}', 0).arguments == '{"a": 1}'
    assert parse_tool_call('{"arguments": {}}', 0) is None
    assert parse_tool_call("[1, 2]", 0) is None
