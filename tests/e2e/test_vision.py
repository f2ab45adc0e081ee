"""An image in chat end to end: the official client sends a data-URL image to a live server on the tiny
Qwen2.5-VL (tests/models/tiny_vl.py), which answers with the continuation the engine computes for the
prompt and pixels transformers' processor prepares from the same image.

Needs the Django side's image preparation (apps/api/images); skipped where it is absent.
"""

from __future__ import annotations

import base64
import io
import random
import shutil
from pathlib import Path

import pytest
from openai import BadRequestError, OpenAI

from tests.e2e.server import start_server
from tests.models.tiny import link_default_gguf
from tests.models.tiny_vl import chat_inputs, image_entries, test_image, tiny_vl_dir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not (ROOT / "apps" / "api" / "images").exists(), reason="no Django-side image preparation"),
]
MODEL = "tiny-qwen2_5_vl"
TEXT = "What is this?"


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the server decodes the very pixels the processor saw
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": TEXT}]}]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_gguf_path):
    root = tmp_path_factory.mktemp("vision")
    models = root / "models"
    link_default_gguf(models, default_gguf_path)
    path = models / MODEL
    shutil.copytree(tiny_vl_dir(default_gguf_path), path)
    proc, base = start_server(root, "--model-id", MODEL, "--model-path", str(path), "--model-idle-unload", "0",
                              env_extra={"IGNIS_SERVER_MODELS_DIR": str(models)})  # fmt: skip
    yield path, OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    proc.stop()


def expected(path: Path, image, n: int) -> tuple[int, list[int]]:
    """(prompt tokens, greedy tokens) of the engine on the processor's inputs (no server)."""
    from engine.backends.numpy import NumpyBackend
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.loaders import load_artifact
    from engine.messages import AddRequest, TokenEvent
    from engine.scheduler import Scheduler

    cfg, weights = load_artifact(path)
    inputs = chat_inputs(path, [image], TEXT)
    ids = inputs["input_ids"][0].tolist()
    be = NumpyBackend()
    plan = be.load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=512)
    sched = Scheduler(EngineConfig(block_size=16), KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0),
                      vision=cfg.vision)  # fmt: skip
    sched.add_request(AddRequest("x", "c", ids, n, sampling={"temperature": 0, "ignore_eos": True},
                                 images=image_entries(inputs, cfg.vision.image_token_id)))  # fmt: skip
    out = []
    while sched.has_work:
        step = sched.schedule()
        out += [t for o in sched.update_from_output(step, be.step(step)) if isinstance(o, TokenEvent)
                for t in o.token_ids]  # fmt: skip
    return len(ids), out


def test_a_data_url_image_is_answered_as_the_engine_computes_it(served):
    from engine.tokenizer import load_tokenizer

    path, client = served
    image = test_image(100, 70)
    resp = client.chat.completions.create(model=MODEL, messages=image_message(data_url(image)),
                                          max_completion_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    prompt_tokens, tokens = expected(path, image, 8)
    assert resp.usage.prompt_tokens == prompt_tokens and resp.usage.completion_tokens == 8
    assert resp.choices[0].message.content == load_tokenizer(path).tokenizer.decode(tokens)


def test_an_undecodable_image_is_refused_with_invalid_image(served):
    _, client = served
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=image_message("data:image/png;base64,bm90IGFuIGltYWdl"),
                                       max_completion_tokens=4)  # fmt: skip
    assert err.value.status_code == 400 and err.value.code == "invalid_image"
