"""The reasoning / content / tool-call splitter on scripted model text, fed in every possible way."""

from __future__ import annotations

import json

import pytest

from apps.api.output_parsers import parse_tool_call
from apps.api.output_split import JsonEcho, OutputSplitter, dump_chars

QWEN = (
    "<think>\nThe user wants the weather. I'll call get_weather.\n</think>\n\n"
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    "</tool_call>"
)


def run(text: str, pieces: list[str], **kw) -> tuple[OutputSplitter, list]:
    sp = OutputSplitter(**kw)
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
    tail = kinds[kinds.index("tool_call_start") :]
    assert set(tail) == {"tool_call_start", "tool_call_args", "tool_call"} and tail[-1] == "tool_call"


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
    sp2 = OutputSplitter()
    assert "".join(e.text for e in sp2.feed("1 < 2")) == "1 < 2"


def test_parse_tool_call_shapes():
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}', 0).arguments == '{"a": 1}'
    assert parse_tool_call('{"name": "f", "parameters": {"a": 1}}', 0).arguments == '{"a": 1}'
    assert parse_tool_call('{"arguments": {}}', 0) is None
    assert parse_tool_call("[1, 2]", 0) is None


def _args_streamed(events, index):
    return "".join(e.text for e in events if e.kind == "tool_call_args" and e.call.index == index)


@pytest.mark.parametrize("pieces", list(chunkings(QWEN)), ids=["whole", "chars", "3s", "7s"])
def test_calls_stream_name_then_arguments_adding_up_to_the_whole_parse(pieces):
    sp, events = run(QWEN, pieces)
    for call in sp.tool_calls:
        kinds = [e.kind for e in events if e.call is call]
        assert kinds[0] == "tool_call_start" and kinds[-1] == "tool_call"
        assert _args_streamed(events, call.index) == call.arguments
        assert (
            call.arguments
            == parse_tool_call(json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}), 0).arguments
        )


def test_arguments_stream_before_the_call_closes():
    sp = OutputSplitter()
    events = sp.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [e.kind for e in events] == ["tool_call_start", "tool_call_args"]
    assert events[0].call.name == "get_weather" and events[1].text == '{"city": "Par'
    events = sp.feed('is", "days": [1,2]}}\n</tool_call>')
    assert _args_streamed(events, 0) == 'is", "days": [1, 2]}' and events[-1].kind == "tool_call"
    assert sp.tool_calls[0].arguments == '{"city": "Paris", "days": [1, 2]}'


CANON = [
    '{"a":1,"b":[1,2.50,{"c":null}],"d":"x\\"y\\u00e9\\ud83d\\ude00\\n\\/","e":true,"f":{}, "g":[]}',
    '{ "city" : "Paris" , "n":-0, "big": 1E5, "ctl": "\\u0001 \u2028 \u00e9", "lone": "\\ud83d" }',
]


@pytest.mark.parametrize("text", CANON)
def test_json_echo_writes_what_json_dumps_writes(text):
    for pieces in chunkings(text + " "):
        echo, out = JsonEcho(), ""
        for p in pieces:
            out += "".join(dump_chars(t) if k == "str_text" else t for k, t, _ in echo.feed(p))
        assert not echo.bad and out == json.dumps(json.loads(text), ensure_ascii=False)


def test_compact_arguments_come_out_as_the_whole_parse_writes_them():
    text = '<tool_call>{"name":"f","arguments":{"q":"a\\u00e9","k":[1,2.0]}}</tool_call>'
    sp, events = run(text, list(text))
    assert _args_streamed(events, 0) == sp.tool_calls[0].arguments == '{"q": "a\u00e9", "k": [1, 2.0]}'


def test_arguments_before_the_name_or_as_a_string_come_whole_at_the_close():
    for body in ('{"arguments": {"a": 1}, "name": "f"}', '{"name": "f", "arguments": "{\\"a\\": 1}"}'):
        text = f"<tool_call>{body}</tool_call>"
        sp = OutputSplitter()
        assert sp.feed(text[:-13]) == []
        events = sp.feed(text[-13:])
        assert [e.kind for e in events] == ["tool_call_start", "tool_call_args", "tool_call"]
        assert events[1].text == '{"a": 1}'


def test_a_started_call_cut_short_keeps_what_streamed():
    sp, events = run(
        '<tool_call>{"name": "f", "arguments": {"a": "lo', ['<tool_call>{"name": "f", "arguments": {"a": "lo']
    )
    assert [c.arguments for c in sp.tool_calls] == ['{"a": "lo'] and events[-1].kind == "tool_call"


@pytest.mark.parametrize("tail", ["<tool_call>\n", "<tool_call>", '<tool_call>\n{"na', "<tool_ca", "<to", "<"])
def test_a_tool_call_cut_before_its_name_leaks_no_tag(tail):
    """Issue 11 point 10: cut by max_tokens inside or before the call's opening, no raw tag is content."""
    for pieces in ([tail], list(tail)):
        sp = OutputSplitter()
        events = [e for p in ["Checking. ", *pieces] for e in sp.feed(p)] + sp.flush()
        shown = "".join(e.text for e in events if e.kind == "content")
        assert shown == "Checking. " and sp.content == "Checking. " and not sp.tool_calls


def test_a_closed_call_that_does_not_parse_is_still_text():
    sp = OutputSplitter()
    events = sp.feed("<tool_call>not json</tool_call>") + sp.flush()
    assert "".join(e.text for e in events if e.kind == "content") == "<tool_call>not json</tool_call>"


def test_the_tags_come_from_the_models_parsers(monkeypatch):
    from apps.api import output_parsers as op

    other = op.OutputParsers("other", op.ReasoningParser("[THINK]", "[/THINK]"), op.ToolParser("[CALL]", "[/CALL]"))
    monkeypatch.setitem(op.FAMILIES, "other", other)
    op._for_template.cache_clear()

    class Tok:
        chat_template = "{% for m in messages %}[CALL]{% endfor %}"

    parsers = op.output_parsers_for(Tok())
    assert parsers is other
    sp = OutputSplitter(parsers=parsers)
    events = sp.feed('[THINK]hm[/THINK]Sure.[CALL]{"name": "f", "arguments": {}}[/CALL]') + sp.flush()
    assert sp.reasoning == "hm" and sp.content == "Sure." and sp.tool_calls[0].name == "f"
    assert [e.kind for e in events][-1] == "tool_call"
    Tok.chat_template = "<tool_call>"
    op._for_template.cache_clear()
    assert op.output_parsers_for(Tok()) is op.DEFAULT and op.DEFAULT.reasoning.opened_by("x <think>\n")
