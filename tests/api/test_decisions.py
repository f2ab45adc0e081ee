"""POST /v1/decisions without a server: the schema's 400s, the prompts, normalisation, score, refusals, usage."""

from __future__ import annotations

import math

import pytest

from apps.api.decisions import service
from apps.api.decisions.answers import answer, option_distribution, score_of, usage_of
from apps.api.decisions.prompt import KEYS, QuestionPrompt, input_text, question_prompt
from apps.api.decisions.schema import MAX_OPTIONS, MAX_QUESTIONS, decisions_parse
from apps.core.errors import IgnisError, InvalidRequest

CAPITAL = {"type": "choice", "instructions": "What is the capital of France?", "choices": [{"value": "Paris"}, {"value": "London"}]}  # fmt: skip


@pytest.fixture(scope="module")
def tok(default_gguf_path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(default_gguf_path)


def body(**kw) -> dict:
    return {"model": "m", "input": "Paris is the capital of France.", "questions": [CAPITAL]} | kw


def refused(b: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decisions_parse(b)
    return info.value


# -- the schema ---------------------------------------------------------------------------

BAD = [
    ({"input": None}, "input", "invalid_type"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": " "}, "input", "invalid_value"),
    ({"input": []}, "input", "empty_array"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
        "input[0].content[0].text",
        "invalid_type",
    ),  # fmt: skip
    (
        {"input": [{"role": "system", "content": [{"type": "input_json", "data": {}}]}]},
        "input[0].content[0].type",
        "invalid_value",
    ),  # fmt: skip
    (
        {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
        "input[0].call_id",
        "invalid_value",
    ),  # fmt: skip
    ({"input": "\ud800"}, "input", "invalid_value"),
    ({"questions": None}, "questions", "invalid_type"),
    ({"questions": []}, "questions", "empty_array"),
    ({"questions": [{"instructions": "x"}]}, "questions[0].type", "missing_required_parameter"),
    ({"input": [{"content": "x"}]}, "input[0].role", "missing_required_parameter"),
    ({"questions": [{"type": "guess", "instructions": "x"}]}, "questions[0].type", "invalid_value"),
    ({"questions": [CAPITAL, {"type": "predicate"}]}, "questions[1].instructions", "missing_required_parameter"),
    ({"questions": [{"type": "predicate", "instructions": " "}]}, "questions[0].instructions", "invalid_value"),
    ({"questions": [{"type": "predicate", "instructions": "x", "name": 7}]}, "questions[0].name", "invalid_type"),
    (
        {"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}]},
        "questions[0].choices",
        "invalid_value",
    ),  # fmt: skip
    (
        {"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": 1}]}]},
        "questions[0].choices[1].value",
        "invalid_type",
    ),  # fmt: skip
    (
        {"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}]},
        "questions[0].choices[1]",
        "invalid_value",
    ),  # fmt: skip
    (
        {"questions": [{"type": "choice", "instructions": "x", "choices": "a,b"}]},
        "questions[0].choices",
        "invalid_type",
    ),  # fmt: skip
    (
        {"questions": [{"type": "score", "instructions": "x", "levels": [{"label": "lo"}, {}]}]},
        "questions[0].levels[1].label",
        "missing_required_parameter",
    ),  # fmt: skip
    (
        {"questions": [{"type": "predicate", "instructions": [{"type": "input_text"}]}]},
        "questions[0].instructions[0].text",
        "missing_required_parameter",
    ),  # fmt: skip
    ({"model": 3}, "model", "invalid_type"),
    ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options.mode", "invalid_value"),
    ({"safety_identifier": "x" * 65}, "safety_identifier", "invalid_value"),
]


@pytest.mark.parametrize("change,param,code", BAD, ids=[p for _, p, _ in BAD])
def test_bad_input_names_the_param(change, param, code):
    err = refused(body(**change))
    assert (err.param, err.code, err.status) == (param, code, 400), err.message


def test_missing_fields_are_named():
    err = refused({"input": "x"})
    assert (err.param, err.code) == ("questions", "missing_required_parameter")
    assert refused({"questions": [CAPITAL]}).param == "input"


def test_limits_are_400_naming_the_limit():
    predicate = {"type": "predicate", "instructions": "x"}
    err = refused(body(questions=[predicate] * (MAX_QUESTIONS + 1)))
    assert (err.param, err.code) == ("questions", "limit_exceeded") and str(MAX_QUESTIONS) in err.message
    many = [{"value": f"v{i}"} for i in range(MAX_OPTIONS + 1)]
    err = refused(body(questions=[predicate, {"type": "choice", "instructions": "x", "choices": many}]))
    assert (err.param, err.code) == ("questions[1].choices", "limit_exceeded") and str(MAX_OPTIONS) in err.message
    levels = [{"label": f"l{i}"} for i in range(MAX_OPTIONS + 1)]
    err = refused(body(questions=[{"type": "score", "instructions": "x", "levels": levels}]))
    assert (err.param, err.code) == ("questions[0].levels", "limit_exceeded")
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["a"] = {}
        node = node["a"]
    err = refused(body(input=[{"role": "user", "content": [{"type": "input_json", "data": deep}]}]))
    assert (err.param, err.code) == ("input[0].content[0].data", "limit_exceeded")


def test_the_sdk_shapes_pass():
    req = decisions_parse(
        body(
            input=[
                {"role": "developer", "content": "Judge the reply."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Sun"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}], "phase": "final_answer"},
            ],
            questions=[
                {"type": "predicate", "name": "p", "instructions": "The reply is sunny."},
                {"type": "choice", "instructions": "x", "choices": [{"value": True}, {"value": "true"}]},
                {
                    "type": "score",
                    "instructions": [{"type": "input_text", "text": "x"}],
                    "levels": [{"label": "a"}, {"label": "b", "description": "d"}],
                },  # fmt: skip
            ],
            prompt_cache_key="k",
            prompt_cache_options={"mode": "implicit", "ttl": "30m"},
            safety_identifier="user-1",
        )
    )
    assert [q["type"] for q in req["questions"]] == ["predicate", "choice", "score"]
    assert [c["value"] for c in req["questions"][1]["choices"]] == [True, "true"]  # typed, not coerced


# -- the prompts ----------------------------------------------------------------------------


def test_a_conversation_is_written_as_turns_and_system_apart():
    system, text = input_text(
        [
            {"role": "system", "content": "Be strict."},
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_json", "data": {"t": 20}}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]
    )
    assert system == "Be strict."
    assert text.splitlines() == [
        "User: Weather?",
        'Assistant called weather({"city":"Paris"}) [call c1]',
        'Output of weather [call c1]: {"t":20}',
        "Assistant: Sunny.",
    ]
    assert input_text([{"role": "user", "content": "Just this."}]) == (None, "Just this.")


def test_an_image_is_refused_with_its_path():
    with pytest.raises(InvalidRequest) as info:
        input_text([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]}])  # fmt: skip
    assert (info.value.param, info.value.code) == ("input[0].content[1]", "unsupported")


def test_options_are_read_by_name_or_else_by_letter(tok):
    q = question_prompt(tok, {"type": "choice", "instructions": "Where?", "choices": [{"value": "Paris"}, {"value": "London"}]}, 0)  # fmt: skip
    assert not q.keyed and "Options: Paris, London" in q.tail
    assert tok.encode(" Paris")[0] in q.option_tokens[0] and tok.encode(" London")[0] in q.option_tokens[1]
    q = question_prompt(tok, {"type": "choice", "instructions": "Where?", "choices": [{"value": "New York"}, {"value": "New Delhi"}]}, 0)  # fmt: skip
    assert q.keyed and "A. New York\nB. New Delhi" in q.tail and q.values == ["New York", "New Delhi"]
    assert tok.encode(" A")[0] in q.option_tokens[0] and tok.encode(" B")[0] in q.option_tokens[1]
    q = question_prompt(tok, {"type": "predicate", "instructions": "Paris is in France."}, 0)
    assert q.values == [True, False] and q.tail.startswith("Statement: Paris is in France.")
    assert tok.encode(" yes")[0] in q.option_tokens[0] and tok.encode(" no")[0] in q.option_tokens[1]
    assert not set(q.refusal_tokens) & {t for toks in q.option_tokens for t in toks}
    assert set(q.token_ids) >= set(q.refusal_tokens) and len(KEYS) == MAX_OPTIONS


def test_every_question_shares_the_input_tokens(tok, monkeypatch):
    served = type("Served", (), {"served_id": "m", "tokenizer": tok})()
    monkeypatch.setattr(service, "model_name_resolve", lambda name: (served, None))
    prep = service.decisions_prepare(
        body(
            input="The Eiffel Tower stands in Paris, the capital of France, on the banks of the Seine river.",
            questions=[
                CAPITAL,
                {"type": "predicate", "instructions": "x"},
                {"type": "score", "instructions": "y", "levels": [{"label": "a"}, {"label": "b"}]},
            ],  # fmt: skip
        )
    )
    n = prep.num_prefix_tokens
    assert n > 16 and len(prep.adds) == 3
    assert len({tuple(a.prompt_token_ids[:n]) for a in prep.adds}) == 1  # one prefix, token for token
    for add, q in zip(prep.adds, prep.questions):
        assert add.decide and add.max_tokens == 0 and add.decide_token_ids == q.token_ids
        assert tok.decode(add.prompt_token_ids, skip_special_tokens=False).endswith("Answer:")
    assert len({a.request_id for a in prep.adds}) == 3 and all(a.request_class == "agent" for a in prep.adds)


def test_a_prompt_over_the_context_is_named(tok, monkeypatch, settings):
    served = type("Served", (), {"served_id": "m", "tokenizer": tok})()
    monkeypatch.setattr(service, "model_name_resolve", lambda name: (served, None))
    settings.IGNIS = {**settings.IGNIS, "model.max_context": 64}
    with pytest.raises(IgnisError) as info:
        service.decisions_prepare(body(input="word " * 200))
    assert (info.value.param, info.value.code) == ("input", "context_length_exceeded")


# -- reading the answers ------------------------------------------------------------------


def _q(kind: str, values: list, tokens: list[list[int]], refusal: list[int] = (), name=None) -> QuestionPrompt:
    return QuestionPrompt(kind, name, values, "", tokens, list(refusal))


def test_probabilities_are_normalised_over_the_options():
    q = _q("choice", ["a", "b", "c"], [[1, 2], [3], [4]], [9], name="n")
    lp = {1: math.log(0.1), 2: math.log(0.1), 3: math.log(0.2), 4: None, 9: math.log(0.01)}
    probs, refused = option_distribution(q, lp)
    assert not refused and math.isclose(sum(probs), 1.0) and probs == pytest.approx([0.5, 0.5, 0.0])
    a = answer(q, lp)
    assert a["type"] == "choice" and a["name"] == "n" and a["choice"] == "a"  # first listed on a tie
    assert a["confidence"] == pytest.approx(0.5)
    assert [p["value"] for p in a["probabilities"]] == ["a", "b", "c"]


def test_a_predicate_is_the_probability_of_yes():
    a = answer(_q("predicate", [True, False], [[1], [2]]), {1: math.log(0.3), 2: math.log(0.1)})
    assert a == {"type": "predicate", "name": None, "probability": pytest.approx(0.75)}


def test_score_is_the_probability_weighted_level_index():
    assert score_of([0.25, 0.25, 0.5]) == pytest.approx(1.25)
    q = _q("score", ["low", "mid", "high"], [[1], [2], [3]])
    a = answer(q, {1: math.log(0.1), 2: math.log(0.1), 3: math.log(0.8)})
    assert a["score"] == pytest.approx(1.7) and a["confidence"] == pytest.approx(0.8)
    assert [(p["label"], p["value"]) for p in a["probabilities"]] == [("low", 0), ("mid", 1), ("high", 2)]


def test_refusal_when_declining_outweighs_every_option():
    q = _q("choice", ["a", "b"], [[1], [2]], [9], name="n")
    assert answer(q, {1: math.log(0.1), 2: math.log(0.1), 9: math.log(0.5)}) == {"type": "refusal", "name": "n"}
    assert answer(q, {1: math.log(0.3), 2: math.log(0.1), 9: math.log(0.35)})["type"] == "choice"


def test_no_mass_at_all_is_uniform_not_a_crash():
    probs, refused = option_distribution(_q("choice", ["a", "b"], [[1], [2]]), {1: None, 2: None})
    assert probs == [0.5, 0.5] and not refused


def test_usage_counts_every_prompt_and_the_engine_cached_tokens():
    assert usage_of([40, 42], [0, 32]) == {
        "input_tokens": 82,
        "input_tokens_details": {"cached_tokens": 32, "cache_write_tokens": 50},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 82,
    }
