"""Issue 11 point 4: a chat request renders its template once, and the process holds one
tokenizer and one llguidance tokenizer per model (the Django side and the engine share them)."""

from __future__ import annotations

import pytest

from apps.api.chat import service as services
from apps.models.services import served_model

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


@pytest.fixture
def renders(monkeypatch, default_gguf_path):
    import engine.chat_template as chat_template

    calls = []
    real = chat_template.render_chat

    def counted(*args, **kw):
        calls.append(kw.get("add_generation_prompt"))
        return real(*args, **kw)

    monkeypatch.setattr(chat_template, "render_chat", counted)
    services._system_block_ids.cache_clear()
    return calls


def test_a_chat_request_renders_its_template_once(renders):
    body = {"messages": [SYSTEM, {"role": "user", "content": "Hi"}], "max_tokens": 4}
    first = services.chat_prepare(body)
    assert first.add.shared_prefix_len > 0
    renders.clear()
    for text in ("What is 2+2?", "Name a colour."):  # the same system block: a burst of subagents
        prep = services.chat_prepare({**body, "messages": [SYSTEM, {"role": "user", "content": text}]})
        assert prep.add.shared_prefix_len == first.add.shared_prefix_len
    assert renders == [True, True]  # the whole prompt each time, the block never again


def test_one_tokenizer_and_one_llguidance_tokenizer_per_model(default_gguf_path):
    from engine.constraint import ConstraintFactory, ll_tokenizer_for
    from engine.tokenizer import shared_tokenizer

    bundle = served_model().tokenizer
    assert shared_tokenizer(served_model().path) is bundle
    factory = ConstraintFactory(served_model().path)
    factory.warm()
    assert factory._tok is ll_tokenizer_for(bundle)  # the engine's grammars and logprobs' token bytes
