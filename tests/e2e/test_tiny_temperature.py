"""Issue 11 point 17: a temperature far below float32's range samples greedily, and the
request that sends it never ends the streams generating beside it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "Count from one to two hundred in words, separated by commas."}]


def test_tiny_temperatures_answer_cleanly_beside_a_running_stream(client):
    neighbour = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=400, temperature=0, stream=True)
    chunks = iter(neighbour)
    first = next(chunks)  # it decodes now: the bad requests share its rounds
    assert first.choices[0].delta.role == "assistant"

    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=1e-50, top_p=0.9)
    greedy = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0)
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content == greedy.choices[0].message.content  # below the floor is greedy

    completion = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=12, temperature=1e-40, top_p=0.5
    )
    plain = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=12, temperature=0)
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].text == plain.choices[0].text

    rest = list(chunks)  # an engine_error event mid-stream would raise here
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in [first, *rest])
