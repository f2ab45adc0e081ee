"""Speculation on the real default model (numpy and cpu backends): the same tokens on and off, 96 a prompt."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.loaders import load_artifact
from engine.messages import AddRequest, TokenEvent
from engine.scheduler import Scheduler
from engine.tokenizer import load_tokenizer

PROMPTS = [
    "Repeat the list exactly: apples, pears, plums, figs, dates, limes, apples, pears, plums, figs, dates, limes,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the",
]
TOKENS = 96  # drafts kept and thrown away (asserted); 200 a prompt cost CI a minute more


@pytest.fixture(scope="module", params=["numpy", "cpu"])
def model(request, default_gguf_path):
    from engine.backends import create_backend
    from engine.config import EngineConfig

    backend = create_backend(request.param, EngineConfig(backend=request.param))
    if backend.name != request.param:
        pytest.skip(f"the {request.param} backend's kernels do not build here")
    as_stored = {"as_stored": True} if getattr(backend, "weights_as_stored", False) else {}
    cfg, weights = load_artifact(default_gguf_path, None, **as_stored)
    plan = backend.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0,
                        max_context=512)  # fmt: skip
    return backend, plan, load_tokenizer(default_gguf_path)


def generate(model, sampling: dict, *, speculate: bool) -> tuple[dict[str, list[int]], int, tuple[int, int]]:
    backend, plan, tok = model
    cfg = EngineConfig(decode_lanes=4, prefill_chunk=256, max_context=512, block_size=16)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0),
                      max_round_rows=backend.max_round_rows if speculate else 0)  # fmt: skip
    for i, text in enumerate(PROMPTS):
        ids = tok.encode(text, add_special_tokens=True)
        add = AddRequest(f"p{i}", "c", ids, TOKENS, sampling={**sampling, "ignore_eos": True})
        assert sched.add_request(add) is None
    out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(PROMPTS))}
    rounds = 0
    while sched.has_work:
        plan_ = sched.schedule()
        rounds += bool(plan_.decode)
        for o in sched.update_from_output(plan_, backend.step(plan_)):
            if isinstance(o, TokenEvent):
                out[o.request_id] += o.token_ids
    stats = sched.make_stats()
    return out, rounds, (sum(stats.spec_drafted.values()), sum(stats.spec_accepted.values()))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "top_p": 0.95, "seed": 11}])
def test_speculation_on_the_default_model_is_token_identical(model, sampling):
    if model[0].name == "numpy" and sampling["temperature"]:
        pytest.skip("sampled rows are the cpu backend's run (the numpy one costs a minute of CI for the same rule)")
    plain, rounds_plain, _ = generate(model, sampling, speculate=False)
    spec, rounds_spec, (drafted, accepted) = generate(model, sampling, speculate=True)
    assert all(len(t) == TOKENS for t in plain.values())
    assert spec == plain
    assert 0 < accepted < drafted  # both paths ran: drafts kept and drafts thrown away
    if sampling["temperature"] == 0:
        assert rounds_spec < rounds_plain  # the copy-heavy prompts let prompt lookup land drafts
