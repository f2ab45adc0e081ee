"""Speculative rounds on the live server through the official client: Predicted Outputs, spec.enabled."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
TEXT = "def area(r):\n    return 3.14159 * r * r\n\n\ndef perimeter(r):\n    return 2 * 3.14159 * r\n"
MESSAGES = [{"role": "user", "content": "Repeat this code exactly, nothing else:\n\n" + TEXT}]


def ask(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=48, temperature=0, **kw
    )  # fmt: skip


def stats(base: str) -> dict:
    return httpx.get(base + "/health", timeout=10).json()["engine"]["stats"]


def test_a_prediction_changes_nothing_in_the_answer_and_is_counted(client, live_server_url):
    plain = ask(client)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens in (None, 0)

    before = stats(live_server_url)["spec_accepted"].get("prediction", 0)
    guided = ask(client, prediction={"type": "content", "content": answer})
    assert guided.choices[0].message.content == answer
    details = guided.usage.completion_tokens_details
    # The answer repeats the prediction from its first token: most of it is accepted.
    assert details.accepted_prediction_tokens >= plain.usage.completion_tokens // 2
    assert details.rejected_prediction_tokens >= 0
    assert stats(live_server_url)["spec_accepted"]["prediction"] - before == details.accepted_prediction_tokens
    spec = guided.usage.model_extra["speculation"]  # extension: every drafter's drafts for this answer
    assert spec["accepted"] >= details.accepted_prediction_tokens and spec["drafted"] >= spec["accepted"]

    wrong = ask(client, prediction={"type": "content", "content": "Completely unrelated words " * 8})
    assert wrong.choices[0].message.content == answer
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens < details.accepted_prediction_tokens


def test_spec_enabled_turns_speculation_off_live(client, live_server_url):
    def patch(on: bool) -> None:
        r = httpx.patch(live_server_url + "/v1/config", json={"spec.enabled": on}, timeout=60)
        assert r.status_code == 200, r.text

    answer = ask(client).choices[0].message.content
    patch(False)
    try:
        before = stats(live_server_url)["spec_drafted"]
        off = ask(client, prediction={"type": "content", "content": answer})
        assert off.choices[0].message.content == answer
        assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0
        assert stats(live_server_url)["spec_drafted"] == before
    finally:
        patch(True)


def test_a_bad_prediction_is_a_400_naming_it(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        ask(client, prediction={"type": "image", "content": "x"})
    assert err.value.body["param"] == "prediction.type"
