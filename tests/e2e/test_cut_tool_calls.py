"""Issue 11 point 10: a tool call cut by max_tokens never leaks a raw tag, with the official client.

``tool_choice: "required"`` makes the grammar open a call at once, so a small cap
cuts it inside or just after ``<tool_call>``: chat content and the Responses
output must hold no piece of the tag (before: content ``'<tool_call>\\n'``, and a
Responses message item ``'<tool_call>'``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CAPS = range(1, 9)


def _leaks(text: str | None) -> bool:
    return bool(text) and ("<tool" in text or "tool_call>" in text)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_cut_call_leaks_no_tag(client, stream):
    for cap in CAPS:
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            max_tokens=cap,
            temperature=0,
            tools=[WEATHER],
            tool_choice="required",
        )
        if stream:
            content = ""
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    content += c.delta.content or ""
        else:
            resp = client.chat.completions.create(**kw)
            assert resp.choices[0].finish_reason in ("length", "tool_calls")
            content = resp.choices[0].message.content
        assert not _leaks(content), (cap, content)


def test_responses_cut_call_adds_no_message_item(client):
    tools = [{"type": "function", **WEATHER["function"]}]
    for cap in CAPS:
        r = client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=tools,
            tool_choice="required",
            max_output_tokens=cap,
            temperature=0,
        )
        texts = [c.text for o in r.output if o.type == "message" for c in o.content]
        assert not any(_leaks(t) for t in texts), (cap, r.output)
        assert r.output_text == ""
