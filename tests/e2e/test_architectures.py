"""Every architecture served end to end: a tiny checkpoint of each, reached by an implicit switch,
answers the official client with the continuation the engine computes for it directly."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.server import start_server
from tests.models.tiny import link_default_gguf
from tests.models.tiny_archs import ARCHS, write_tiny

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_gguf_path):
    root = tmp_path_factory.mktemp("archs")
    mdir = root / "models"
    link_default_gguf(mdir, default_gguf_path)
    for arch in ARCHS:
        write_tiny(arch, mdir / f"tiny-{arch}", default_gguf_path)
    ids = ",".join(f"tiny-{a}" for a in ARCHS)
    proc, base = start_server(root / "var", "--model-idle-unload", "0", "--switch-known-models", ids,
                              "--switch-drain-timeout", "1", env_extra={"IGNIS_SERVER_MODELS_DIR": str(mdir)})  # fmt: skip
    yield base, mdir
    proc.stop()


def expected_text(path, default_gguf_path, n: int) -> str:
    """The greedy continuation the numpy backend gives the chat prompt, detokenized (no server)."""
    import random

    from engine.backends.numpy import NumpyBackend
    from engine.chat_template import render_chat
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.loaders import load_artifact
    from engine.messages import AddRequest, TokenEvent
    from engine.scheduler import Scheduler
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    prompt = render_chat(tok.chat_template, MESSAGES, bos_token=tok.bos_token, eos_token=tok.eos_token)
    cfg, weights = load_artifact(path)
    be = NumpyBackend()
    plan = be.load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=512)
    sched = Scheduler(EngineConfig(block_size=16), KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0))
    sched.add_request(AddRequest("x", "c", tok.encode(prompt, add_special_tokens=True), n,
                                 sampling={"temperature": 0, "ignore_eos": True}))  # fmt: skip
    out = []
    while sched.has_work:
        step = sched.schedule()
        out += [
            t for o in sched.update_from_output(step, be.step(step)) if isinstance(o, TokenEvent) for t in o.token_ids
        ]
    return tok.tokenizer.decode(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_answers_the_official_client(served, arch, default_gguf_path):
    base, mdir = served
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    resp = client.chat.completions.create(model=f"tiny-{arch}", messages=MESSAGES, max_completion_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.model == f"tiny-{arch}"
    assert resp.usage.completion_tokens == 8
    assert resp.choices[0].message.content == expected_text(mdir / f"tiny-{arch}", default_gguf_path, 8)
