"""A K-quant GGUF (the Q4_K_M fixture: Q4_K and Q6_K blocks, made by llama.cpp's llama-quantize)
served end to end on the numpy backend: the official client gets the greedy continuation the
engine computes for the file directly."""

from __future__ import annotations

import os
import shutil

import pytest
from openai import OpenAI

from tests.e2e.server import start_server
from tests.e2e.test_architectures import MESSAGES, expected_text
from tests.loaders.tiny_gguf import FIXTURES

pytestmark = pytest.mark.e2e
MODEL = "tiny-q4-k-m"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquant")
    path = root / "models" / MODEL / "model.gguf"  # artifacts must lie inside the models directory
    path.parent.mkdir(parents=True)
    try:
        os.link(FIXTURES / "tiny-Q4_K_M.gguf", path)
    except OSError:
        shutil.copy2(FIXTURES / "tiny-Q4_K_M.gguf", path)
    flags = ("--model-id", MODEL, "--model-path", str(path), "--model-backend", "numpy", "--model-idle-unload", "0")
    proc, base = start_server(root, *flags, env_extra={"IGNIS_SERVER_MODELS_DIR": str(root / "models")})
    yield base, path
    proc.stop()


def test_a_k_quant_gguf_answers_the_official_client(served):
    base, path = served
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.model == MODEL and resp.usage.completion_tokens == 8
    assert resp.choices[0].message.content == expected_text(path, None, 8)
