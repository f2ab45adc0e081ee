"""POST /v1/decide: one prefill, a label distribution, no token decoded."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.e2e.server import engine_stats
from tests.helpers import assert_openai_error

pytestmark = pytest.mark.e2e

PARIS = {"evidence": "Paris is the capital of France.", "question": "What is the capital of France?"}


def decide(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/decide", json=body, timeout=120)


@pytest.mark.parametrize("labels", [["Paris", "London"], ["London", "Paris"]])
def test_easy_question_gets_the_right_label(live_server_url, labels):
    resp = decide(live_server_url, **PARIS, labels=labels)
    assert resp.status_code == 200, resp.text
    d = resp.json()
    assert d["object"] == "decision" and d["id"].startswith("decision-")
    assert d["label"] == "Paris"
    assert [x["label"] for x in d["distribution"]] == labels
    assert math.isclose(sum(x["probability"] for x in d["distribution"]), 1.0, abs_tol=1e-9)
    assert all(0.0 <= x["probability"] <= 1.0 for x in d["distribution"])
    assert 0.0 < d["label_mass"] <= 1.0
    assert d["usage"]["completion_tokens"] == 0 and d["usage"]["prompt_tokens"] > 10


def test_decide_decodes_nothing_and_takes_no_lane(live_server_url):
    before = engine_stats(live_server_url)
    resp = decide(
        live_server_url,
        evidence="The sky is blue.",
        question="Is the sky blue?",
        labels=["yes", "no"],
        model="smollm2-135m-instruct",
    )
    assert resp.status_code == 200, resp.text
    d = resp.json()
    assert d["label"] in ("yes", "no")
    assert math.isclose(sum(x["probability"] for x in d["distribution"]), 1.0, abs_tol=1e-9)
    after = engine_stats(live_server_url)
    assert after["decoded_tokens"] == before["decoded_tokens"]
    assert after["decode_rounds"] == before["decode_rounds"]
    assert after["lanes_busy"] == 0


def test_repeat_resumes_from_retained_prompt(live_server_url):
    first = decide(live_server_url, **PARIS, labels=["Paris", "Rome", "Berlin"]).json()
    again = decide(live_server_url, **PARIS, labels=["Paris", "Rome", "Berlin"]).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (first["usage"]["prompt_tokens"] // 16) * 16
    assert again["label"] == first["label"]


BAD = [
    ({"labels": ["a", "b"]}, "question"),
    ({"question": "q?"}, "labels"),
    ({"question": "q?", "labels": "yes,no"}, "labels"),
    ({"question": "q?", "labels": ["only"]}, "labels"),
    ({"question": "q?", "labels": ["a", 3]}, "labels[1]"),
    ({"question": "q?", "labels": ["a", " "]}, "labels[1]"),
    ({"question": "q?", "labels": ["yes", "yes"]}, "labels"),
    ({"question": "q?", "labels": ["New York", "New Delhi"]}, "labels"),  # one first token
    ({"question": 5, "labels": ["a", "b"]}, "question"),
    ({"question": "q?", "labels": ["a", "b"], "evidence": []}, "evidence"),
    ({"question": "q?", "labels": ["a", "b"], "class": "vip"}, "class"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_400_naming_param(live_server_url, body, param):
    assert_openai_error(decide(live_server_url, **body), 400, param=param)


def test_ambiguous_labels_say_why(live_server_url):
    err = assert_openai_error(
        decide(live_server_url, question="Where?", labels=["New York", "New Delhi"]),
        400,
        code="ambiguous_labels",
        param="labels",
    )
    assert "same token" in err["message"]


def test_unknown_model_is_404(live_server_url):
    assert_openai_error(decide(live_server_url, question="q?", labels=["a", "b"], model="nope"), 404)
