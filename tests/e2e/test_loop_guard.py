"""The reasoning loop guard and the thinking budget on the real default model, through the official client.

SmolLM2 does not think by itself. The server here serves a copy of its GGUF whose chat template
opens the assistant turn with ``<think>\\n`` (a test-only template, written next to the original's
weights with gguf's own metadata rewriter), so the model reasons; asked to repeat a phrase, greedy
SmolLM2 loops inside that reasoning, and the guard takes the loop back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.e2e.server import free_port, start_server
from tests.e2e.test_metrics import Scrape
from tests.models.tiny import link_default_gguf

pytestmark = pytest.mark.e2e
MODEL = "smollm2-think"
LOOPY = [{"role": "user", "content": "Repeat after me: I think, I think, I think, I think, I think"}]
_CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / f"ignis-smollm2-think-{os.getuid()}.gguf"


def thinking_gguf(default_gguf: Path) -> Path:
    """The default GGUF with a chat template whose assistant turn opens with ``<think>\\n`` (cached)."""
    from engine.tokenizer import load_tokenizer

    if _CACHE.exists():
        return _CACHE
    template = load_tokenizer(default_gguf).chat_template
    thinking = template.replace("assistant\n' }}", "assistant\n<think>\n' }}")
    assert thinking != template, "the default template's generation prompt moved"
    tmp = _CACHE.with_name(_CACHE.name + f".{os.getpid()}")
    jinja = tmp.with_suffix(".jinja")
    jinja.write_text(thinking)
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--chat-template-file", str(jinja),
         str(default_gguf), str(tmp)],
        check=True, capture_output=True,
    )  # fmt: skip
    jinja.unlink()
    tmp.rename(_CACHE)
    return _CACHE


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_gguf_path):
    root = tmp_path_factory.mktemp("loop-guard")
    models = root / "models"
    link_default_gguf(models, default_gguf_path)
    path = models / MODEL / "model.gguf"  # artifacts must lie inside the models directory
    path.parent.mkdir()
    try:
        os.link(thinking_gguf(default_gguf_path), path)
    except OSError:
        shutil.copy2(thinking_gguf(default_gguf_path), path)
    metrics_port = free_port()
    flags = ("--model-id", MODEL, "--model-path", str(path), "--model-idle-unload", "0",
             "--server-metrics-bind", f"127.0.0.1:{metrics_port}")  # fmt: skip
    proc, base = start_server(root, *flags, env_extra={"IGNIS_SERVER_MODELS_DIR": str(models)})
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield proc, client, f"http://127.0.0.1:{metrics_port}/metrics"
    proc.stop()


def test_a_reasoning_loop_is_taken_back_and_the_answer_follows(served):
    proc, client, metrics = served
    before = Scrape(metrics)
    stream = client.chat.completions.create(
        model=MODEL, messages=LOOPY, max_completion_tokens=48, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    order, markers, usage = [], [], None
    for chunk in stream:  # the official client's models parse every chunk, the marker's included
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            order.append("reasoning")
        if extra.get("taken_back"):
            markers.append(extra["taken_back"])
            order.append("marker")
        if delta.content:
            order.append("content")
    assert len(markers) == 1 and markers[0]["reason"] == "loop" and markers[0]["tokens"] > 0, markers
    first_marker = order.index("marker")
    assert "reasoning" in order[:first_marker] and "content" in order[first_marker:]
    assert "reasoning" not in order[first_marker:] and "content" not in order[:first_marker]
    taken = markers[0]["tokens"]
    assert usage.completion_tokens_details.model_extra["taken_back_tokens"] == taken
    assert usage.completion_tokens == 48  # max_tokens caps every generated token, the taken-back ones too
    after = Scrape(metrics)
    assert (
        after.value("ignis_loop_guard_fired_total", reason="loop")
        == before.value("ignis_loop_guard_fired_total", reason="loop") + 1
    )
    assert (
        after.value("ignis_loop_guard_taken_back_tokens_total")
        - before.value("ignis_loop_guard_taken_back_tokens_total")
        == taken
    )
    events = [e for e in proc.events() if e.get("event") == "ignis.loop_guard.taken_back" and e["reason"] == "loop"]
    assert events[-1]["taken_back"] == taken and events[-1]["span"] > 0 and events[-1]["request_id"]


def test_a_thinking_budget_closes_the_reasoning_in_responses(served):
    _, client, _ = served
    resp = client.responses.create(
        model=MODEL, input="What is 2+2?", max_output_tokens=24, temperature=0,
        extra_body={"max_reasoning_tokens": 4},
    )  # fmt: skip
    kinds = [item.type for item in resp.output]
    assert kinds[:2] == ["reasoning", "message"], kinds
    reasoning = resp.output[0]
    assert reasoning.model_extra["taken_back"] == [{"tokens": 0, "reason": "budget"}]
    assert resp.output_text
    assert resp.usage.output_tokens_details.reasoning_tokens == 4  # the forced end tag is not the model's reasoning
    assert resp.usage.output_tokens_details.model_extra.get("taken_back_tokens") is None  # nothing taken back


def test_bad_budget_fields_are_refused_naming_them(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=LOOPY, max_tokens=4, extra_body={"max_reasoning_tokens": -1}
        )
    assert err.value.body["param"] == "max_reasoning_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", extra_body={"reasoning": {"effort": "huge"}})
    assert err.value.body["param"] == "reasoning.effort"


def test_the_guard_turns_off_live(served):
    import httpx

    _, client, metrics = served
    base = str(client.base_url).rstrip("/").removesuffix("/v1")

    def patch(on: bool) -> None:
        r = httpx.patch(base + "/v1/config", json={"spec.loop_guard": on}, timeout=60)
        assert r.status_code == 200, r.text

    patch(False)
    try:
        before = Scrape(metrics).value("ignis_loop_guard_fired_total", reason="loop")
        resp = client.chat.completions.create(model=MODEL, messages=LOOPY, max_completion_tokens=36, temperature=0)
        msg = resp.choices[0].message
        assert "taken_back" not in (msg.model_extra or {}) and resp.choices[0].finish_reason == "length"
        assert not msg.content  # still looping inside the reasoning when the cap came
        assert Scrape(metrics).value("ignis_loop_guard_fired_total", reason="loop") == before
    finally:
        patch(True)
