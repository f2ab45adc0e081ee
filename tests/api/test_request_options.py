"""Validation of the chat / completions options, the tool prompt and the grammars they build."""

from __future__ import annotations

import json

import pytest

from apps.api import tools as tool_mod
from apps.api.validation import MAX_N, parse_chat_request, parse_completion_request
from apps.core.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def refused(body: dict, param: str | None = None, parse=parse_chat_request) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    if param is not None:
        assert info.value.param == param, info.value.message
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": "2"}, "n"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"tools": [WEATHER] * 2}, "tools[1].function.name"),
        ({"tools": [{"type": "code"}]}, "tools[0].type"),
        ({"tools": [WEATHER] * (tool_mod.MAX_TOOLS + 1)}, "tools"),
        ({"tools": {"a": 1}}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format.json_schema.schema",
        ),
        ({"deadline": 0}, "deadline"),
        ({"deadline": 10**9}, "deadline"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_out_of_bounds_options_are_refused_with_their_param(body, param):
    refused({"messages": MSG, **body}, param)


def test_a_full_request_parses_and_ignores_unknown_fields():
    req = parse_chat_request(
        {
            "messages": MSG,
            "n": 3,
            "logprobs": True,
            "top_logprobs": 20,
            "max_completion_tokens": 7,
            "seed": 5,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "stop": "x",
            "deadline": 30,
            "user": "u",
            "metadata": {"a": 1},
            "store": False,
            "service_tier": "auto",
            "some_future_field": [1, 2],
        }
    )
    assert (req.n, req.top_logprobs, req.max_tokens, req.stop, req.deadline) == (3, 20, 7, ["x"], 30.0)
    assert isinstance(req.tool_choice, tool_mod.Tool) and req.tool_choice.name == "get_weather"
    assert req.grammar and "get_weather" in req.grammar


def test_json_modes_build_grammars():
    assert parse_chat_request({"messages": MSG, "response_format": {"type": "json_object"}}).grammar
    assert parse_chat_request({"messages": MSG, "response_format": {"type": "text"}}).grammar is None
    req = parse_chat_request({"messages": MSG, "tools": [WEATHER]})
    assert req.tool_choice == "auto" and req.grammar is None  # auto: parsed, not forced


def test_legacy_completion_prompts_and_bounds():
    assert parse_completion_request({"prompt": "a"}).prompts == ["a"]
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion_request({"prompt": ["a", "b"], "n": 2}).n == 2
    assert parse_completion_request({"prompt": "a", "max_tokens": 0, "echo": True}).max_tokens == 0
    refused({"prompt": ["a"] * 5, "n": 2}, "n", parse_completion_request)
    refused({"prompt": [[1], "a"]}, "prompt", parse_completion_request)
    refused({}, "prompt", parse_completion_request)
    refused({"prompt": "a", "logprobs": 21}, "logprobs", parse_completion_request)
    refused({"prompt": "a", "best_of": 3}, "best_of", parse_completion_request)


def test_tool_prompt_for_a_template_without_tools():
    tools = tool_mod.tools_parse([WEATHER])
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    messages, template_tools = tool_mod.tools_prompt_apply(history, tools, "{{ messages }}")
    assert template_tools is None
    assert messages[0]["content"].startswith("Be brief.") and "<tools>" in messages[0]["content"]
    assert (
        json.loads(messages[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0])["function"]["name"]
        == "get_weather"
    )
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "tool", "content": "<tool_response>\n18C\n</tool_response>"}
    # A template that renders tools itself gets them as they are.
    same, template_tools = tool_mod.tools_prompt_apply(history, tools, "{% for t in tools %}{% endfor %}")
    assert same is history and template_tools[0]["function"]["name"] == "get_weather"


@pytest.fixture(scope="module")
def factory(default_gguf_path):
    from engine.constraint import ConstraintFactory

    f = ConstraintFactory(default_gguf_path)
    f.warm()
    return f


def test_forced_tool_call_grammar_accepts_calls_and_nothing_else(factory):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(factory.artifact_path)
    tools = tool_mod.tools_parse([WEATHER, {"type": "function", "function": {"name": "noop"}}])
    one = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name":"noop","arguments":{}}\n</tool_call>'

    def accepts(grammar: str, text: str) -> bool:
        con = factory.build(grammar, list(tok.eos_token_ids))
        ids = tok.encode(text)
        return (
            con.matcher.validate_tokens(ids) == len(ids)
            and con.matcher.consume_tokens(ids)
            and con.matcher.is_accepting()
        )

    required = tool_mod.tool_choice_grammar("required", tools, parallel=True)
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(required, "Sure! " + one)
    assert not accepts(required, '<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>')  # city required
    single = tool_mod.tool_choice_grammar("required", tools, parallel=False)
    assert accepts(single, one) and not accepts(single, two)
    named = tool_mod.tool_choice_grammar(tools[1], tools, parallel=False)
    assert accepts(named, '<tool_call>\n{"name":"noop","arguments":{}}\n</tool_call>') and not accepts(named, one)
