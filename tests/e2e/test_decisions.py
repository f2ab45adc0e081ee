"""POST /v1/decisions with the official SDK's client.decisions.create against the live server."""

from __future__ import annotations

import math
import uuid

import httpx
import openai
import pytest

from tests.e2e.server import engine_stats
from tests.helpers import assert_openai_error

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PARIS = "Paris is the capital of France."


def capital(choices: list, name: str | None = "capital") -> dict:
    q = {"type": "choice", "instructions": "What is the capital of France?", "choices": [{"value": v} for v in choices]}
    return q | ({"name": name} if name else {})


@pytest.mark.parametrize("choices", [["Paris", "London"], ["London", "Paris"]])
def test_easy_choice_gets_the_right_answer(client, choices):
    d = client.decisions.create(model=MODEL, input=PARIS, questions=[capital(choices)])
    (a,) = d.answers
    assert a.type == "choice" and a.name == "capital" and a.choice == "Paris"
    assert [p.value for p in a.probabilities] == choices
    assert math.isclose(sum(p.probability for p in a.probabilities), 1.0, abs_tol=1e-9)
    assert a.confidence == max(p.probability for p in a.probabilities)
    assert d.model == MODEL and d.usage.output_tokens == 0 and d.usage.input_tokens > 10


def test_answers_come_in_question_order_with_names_normalised(client):
    questions = [
        {"type": "predicate", "name": "fact", "instructions": "Paris is the capital of France."},
        capital(["London", "Paris", "Berlin"], name=None),
        {"type": "score", "name": "formality", "instructions": "How formal is the text?",
         "levels": [{"label": "low"}, {"label": "medium", "description": "plain"}, {"label": "high"}]},
        {"type": "choice", "name": "typed", "instructions": "Is the text true?",
         "choices": [{"value": True}, {"value": "true"}, {"value": False}]},
        {"type": "choice", "name": "shared-first-token", "instructions": "Which city is named?",
         "choices": [{"value": "New York"}, {"value": "New Delhi"}]},
    ]  # fmt: skip
    d = client.decisions.create(model=MODEL, input=PARIS, questions=questions)
    assert [a.type for a in d.answers] == ["predicate", "choice", "score", "choice", "choice"]
    assert [a.name for a in d.answers] == ["fact", None, "formality", "typed", "shared-first-token"]
    fact, city, score, typed, shared = d.answers
    assert 0.0 <= fact.probability <= 1.0
    assert city.choice == "Paris"
    for a in (city, score, typed, shared):
        assert math.isclose(sum(p.probability for p in a.probabilities), 1.0, abs_tol=1e-9)
        assert all(0.0 <= p.probability <= 1.0 for p in a.probabilities)
    assert [(p.label, p.value) for p in score.probabilities] == [("low", 0), ("medium", 1), ("high", 2)]
    assert math.isclose(score.score, sum(p.value * p.probability for p in score.probabilities), abs_tol=1e-9)
    assert 0.0 <= score.score <= 2.0 and score.confidence == max(p.probability for p in score.probabilities)
    assert [p.value for p in typed.probabilities] == [True, "true", False]  # typed values come back typed
    assert type(typed.probabilities[0].value) is bool and type(typed.probabilities[1].value) is str
    assert [p.value for p in shared.probabilities] == ["New York", "New Delhi"]  # read through letters


def test_the_input_is_computed_once_and_nothing_decoded(client, live_server_url):
    before = engine_stats(live_server_url)
    fresh = f"Note {uuid.uuid4().hex}: the Eiffel Tower stands in Paris, the capital of France, by the Seine."
    questions = [capital(["Paris", "London"]), {"type": "predicate", "instructions": "The note is about Paris."},
                 {"type": "score", "instructions": "How long is the note?", "levels": [{"label": "short"}, {"label": "long"}]}]  # fmt: skip
    first = client.decisions.create(model=MODEL, input=fresh, questions=questions)
    again = client.decisions.create(model=MODEL, input=fresh, questions=questions)
    after = engine_stats(live_server_url)
    assert after["decoded_tokens"] == before["decoded_tokens"] and after["decode_rounds"] == before["decode_rounds"]
    assert after["lanes_busy"] == 0
    u, v = first.usage, again.usage
    assert u.total_tokens == u.input_tokens and u.output_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    # The 2nd and 3rd questions claim the input's blocks the 1st computed (a ~60-token prefix: 3 blocks each).
    assert u.input_tokens_details.cached_tokens >= 2 * 48
    assert u.input_tokens_details.cache_write_tokens == u.input_tokens - u.input_tokens_details.cached_tokens
    # Asked again, the first question resumes from retained state too.
    assert (
        v.input_tokens == u.input_tokens and v.input_tokens_details.cached_tokens > u.input_tokens_details.cached_tokens
    )
    # The same answers, up to rounding: a claimed prefix is not recomputed, and the tail runs other
    # kernels than a cold prefill did (the cpu backend's tiled prefill: ~2e-4 of the largest logit).
    for a, b in zip(again.answers, first.answers):
        assert (a.type, a.name) == (b.type, b.name)
    assert again.answers[0].choice == first.answers[0].choice
    assert again.answers[1].probability == pytest.approx(first.answers[1].probability, abs=2e-3)
    assert again.answers[2].score == pytest.approx(first.answers[2].score, abs=2e-3)


def test_a_conversation_with_tool_calls_is_input(client):
    d = client.decisions.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Judge the assistant's last reply."},
            {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"country":"France"}'},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "Paris"}],
            },  # fmt: skip
            {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        ],
        questions=[{"type": "predicate", "name": "p", "instructions": "The assistant answered the question."}],
        prompt_cache_key="tenant-1",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"},
        safety_identifier="user-1",
    )
    assert d.answers[0].type == "predicate" and d.answers[0].name == "p"


def bad_request(client, **body) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.decisions.create(**({"model": MODEL, "input": PARIS} | body))
    return info.value


def test_limits_are_400_naming_the_limit(client):
    predicate = {"type": "predicate", "instructions": "x"}
    err = bad_request(client, questions=[predicate] * 65)
    assert (err.code, err.param) == ("limit_exceeded", "questions") and "64" in err.message
    many = [f"v{i}" for i in range(27)]
    err = bad_request(client, questions=[predicate, capital(many)])
    assert (err.code, err.param) == ("limit_exceeded", "questions[1].choices") and "26" in err.message


def test_bad_questions_name_the_param(client):
    err = bad_request(client, questions=[capital(["Paris", "Paris"])])
    assert (err.code, err.param) == ("invalid_value", "questions[0].choices[1]")
    err = bad_request(client, questions=[{"type": "score", "instructions": "x", "levels": [{"label": "lo"}, {}]}])
    assert (err.code, err.param) == ("missing_required_parameter", "questions[0].levels[1].label")
    img = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]
    err = bad_request(client, input=img, questions=[capital(["Paris", "London"])])
    assert (err.code, err.param) == ("unsupported", "input[0].content[0]")


def test_raw_bodies_get_the_envelope(live_server_url):
    post = lambda body: httpx.post(live_server_url + "/v1/decisions", json=body, timeout=60)  # noqa: E731
    assert_openai_error(post({"questions": [capital(["a", "b"])]}), 400, "missing_required_parameter", "input")
    assert_openai_error(post({"input": "x", "questions": "all"}), 400, "invalid_type", "questions")
    assert_openai_error(post({"input": "x", "questions": [{"type": "choice", "instructions": "x", "choices": [{"value": 1}, {"value": "b"}]}]}), 400, "invalid_type", "questions[0].choices[0].value")  # fmt: skip
    assert_openai_error(post({"input": "x", "questions": [capital(["a", "b"])], "model": "nope"}), 404)
