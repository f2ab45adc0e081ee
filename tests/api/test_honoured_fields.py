"""Fields once accepted and ignored (issue 11 point 9) are honoured or refused: reasoning under both
names, reasoning_effort as the template's thinking switch, ignore_eos / min_tokens / logit_bias into
the engine request, Responses text.format as a grammar. No engine: its messages are scripted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from apps.api.chat.service import chat_prompt
from apps.api.responses import response_parse, response_prepare
from apps.api.thinking import thinking_kwargs
from apps.api.validation import parse_chat_request, parse_completion_request
from apps.core.errors import InvalidRequest
from tests.api.test_chat_consumer import _run, tokenizer  # noqa: F401 - fixtures (offline: tests/api/conftest.py)

MSG = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
QWEN_LIKE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)


def test_reasoning_streams_as_reasoning_content_and_reasoning(offline, tokenizer):  # noqa: F811
    chunks = asyncio.run(_run({"messages": MSG, "stream": True, "tools": TOOLS}, 3, offline, tokenizer))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Weather needs a tool."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_whole_message_carries_reasoning_under_both_names(offline, tokenizer):  # noqa: F811
    (resp,) = asyncio.run(_run({"messages": MSG, "tools": TOOLS}, 5, offline, tokenizer))
    msg = resp["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "Weather needs a tool."


def test_engine_options_reach_the_engine_request(offline, tokenizer):  # noqa: F811
    body = {"messages": MSG, "ignore_eos": True, "min_tokens": 4, "logit_bias": {"17": 5.5, "3": -100}}
    asyncio.run(_run(body, 1000, offline, tokenizer))
    sampling = offline[0].sampling
    assert sampling["ignore_eos"] is True and sampling["min_tokens"] == 4
    assert sorted(map(tuple, sampling["logit_bias"])) == [(3, -100.0), (17, 5.5)]


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "invalid_value"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "invalid_type"),
        ({"logit_bias": [1]}, "logit_bias", "invalid_type"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999", "invalid_value"),  # outside the vocabulary
        ({"min_tokens": -1}, "min_tokens", "invalid_value"),
        ({"ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos", "invalid_value"),
        ({"reasoning_effort": "maximal"}, "reasoning_effort", "invalid_value"),
    ],
)
def test_bad_engine_options_are_refused_naming_them(tokenizer, body, param, code):  # noqa: F811
    for parse, base in ((parse_chat_request, {"messages": MSG}), (parse_completion_request, {"prompt": "hi"})):
        if parse is parse_completion_request and "reasoning_effort" in body:
            continue
        with pytest.raises(InvalidRequest) as info:
            parse({**base, **body})
        assert (info.value.param, info.value.code) == (param, code), info.value.message


def test_completions_carry_the_engine_options():
    req = parse_completion_request({"prompt": "hi", "min_tokens": 2, "ignore_eos": True, "logit_bias": {"4": 1}})
    assert req.sampling["min_tokens"] == 2 and req.sampling["ignore_eos"] and req.sampling["logit_bias"] == [[4, 1.0]]


def _served(template: str):
    tok = SimpleNamespace(chat_template=template, bos_token="", eos_token="", encode=lambda text: list(text.encode()))
    return SimpleNamespace(tokenizer=tok)


def test_reasoning_effort_drives_a_template_thinking_switch():
    served = _served(QWEN_LIKE)
    off, _ = chat_prompt(parse_chat_request({"messages": MSG, "reasoning_effort": "none"}), served)
    on, _ = chat_prompt(parse_chat_request({"messages": MSG, "reasoning_effort": "high"}), served)
    plain, _ = chat_prompt(parse_chat_request({"messages": MSG}), served)
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n") and on == plain
    # An explicit chat_template_kwargs.enable_thinking wins.
    body = {"messages": MSG, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert chat_prompt(parse_chat_request(body), served)[0] == off


def test_reasoning_effort_without_a_switch_is_refused_unless_it_asks_for_none():
    served = _served("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_prompt(parse_chat_request({"messages": MSG, "reasoning_effort": "minimal"}), served)[0]
    with pytest.raises(InvalidRequest) as info:
        chat_prompt(parse_chat_request({"messages": MSG, "reasoning_effort": "low"}), served)
    assert (info.value.param, info.value.code) == ("reasoning_effort", "unsupported")
    assert thinking_kwargs({"x": 1}, None, None, param="reasoning_effort") == {"x": 1}


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
    "required": ["city", "temp"],
    "additionalProperties": False,
}


def test_responses_text_format_json_schema_constrains_and_is_echoed(tokenizer):  # noqa: F811
    fmt = {"type": "json_schema", "name": "Weather", "schema": SCHEMA, "strict": True}
    prep = response_prepare(response_parse({"input": "Weather?", "text": {"format": fmt}}), None)
    assert prep.add.grammar and "json_schema" in prep.add.grammar
    assert prep.base["text"] == {"format": fmt}
    plain = response_prepare(response_parse({"input": "Weather?"}), None)
    assert plain.add.grammar is None and plain.base["text"] == {"format": {"type": "text"}}
    obj = response_prepare(response_parse({"input": "x", "text": {"format": {"type": "json_object"}}}), None)
    assert obj.add.grammar


@pytest.mark.parametrize(
    "text, param, code",
    [
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema", "missing_required_parameter"),
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}},
            "text.format.schema",
            "invalid_schema",
        ),
        ({"format": {"type": "xml"}}, "text.format.type", "invalid_value"),
        ({"format": "json"}, "text.format", "invalid_type"),
    ],
)
def test_responses_bad_text_format_is_refused_naming_its_path(text, param, code):
    with pytest.raises(InvalidRequest) as info:
        response_parse({"input": "x", "text": text})
    assert (info.value.param, info.value.code) == (param, code), info.value.message


def test_responses_reasoning_effort_is_echoed_and_refused_without_a_switch(tokenizer):  # noqa: F811
    with pytest.raises(InvalidRequest) as info:
        response_prepare(response_parse({"input": "x", "reasoning": {"effort": "high"}}), None)
    assert (info.value.param, info.value.code) == ("reasoning.effort", "unsupported")
    prep = response_prepare(response_parse({"input": "x", "reasoning": {"effort": "none"}}), None)
    assert prep.base["reasoning"]["effort"] == "none"


def test_reasoning_effort_reaches_a_template_that_reads_it():
    served = _served("Reasoning: {{ reasoning_effort | default('medium') }}")  # gpt-oss's harmony
    for effort, shown in (("high", "high"), ("low", "low"), ("none", "low"), (None, "medium")):
        body = {"messages": MSG, **({"reasoning_effort": effort} if effort else {})}
        assert chat_prompt(parse_chat_request(body), served)[0] == f"Reasoning: {shown}"
    body = {"messages": MSG, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert chat_prompt(parse_chat_request(body), served)[0] == "Reasoning: low"
