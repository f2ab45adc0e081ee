"""Speculative rounds on the CUDA backend: a lane's verify rows are rows of the round (one per
position, the drafts' K/V written before any row attends), so the committed tokens must equal
speculation off, greedy and sampled. Skipped without a device."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]


def generate(backend, plan, prompts, sampling, rows: int) -> tuple[dict, dict]:
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest, TokenEvent
    from engine.scheduler import Scheduler

    cfg = EngineConfig(decode_lanes=4, prefill_chunk=256, max_context=1024, block_size=16)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0), max_round_rows=rows)
    for i, ids in enumerate(prompts):
        assert sched.add_request(AddRequest(f"p{i}", "c", ids, 96, sampling={**sampling, "ignore_eos": True})) is None
    out = {f"p{i}": [] for i in range(len(prompts))}
    while sched.has_work:
        step = sched.schedule()
        assert len(step.decode) <= max(rows, len(sched.running))
        for o in sched.update_from_output(step, backend.step(step)):
            if isinstance(o, TokenEvent):
                out[o.request_id] += o.token_ids
    return out, sched.make_stats().spec_drafted


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}])
def test_speculation_on_cuda_commits_the_tokens_speculation_off_does(sampling):
    from engine.backends import create_backend
    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.test_cuda_archs import random_weights

    cfg = ModelConfig(arch="llama", vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position=2048, tie_word_embeddings=True)  # fmt: skip
    weights = random_weights(definition("llama"), cfg, seed=3)
    be = create_backend("cuda")
    plan = be.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
    try:
        rng = np.random.default_rng(4)
        unit = rng.integers(0, 384, 12).tolist()
        prompts = [unit * 4, rng.integers(0, 384, 30).tolist(), unit * 2 + unit[:5]]
        plain, _ = generate(be, plan, prompts, sampling, rows=0)
        spec, drafted = generate(be, plan, prompts, sampling, rows=be.max_round_rows)
        assert drafted.get("prompt_lookup", 0) > 0  # rounds did carry several rows of one lane
        assert spec == plain
    finally:
        be.unload()
