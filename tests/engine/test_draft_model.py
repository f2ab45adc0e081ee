"""spec.draft_model: a draft model proposes every lane's drafts; the output stays the target's."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import AddRequest, TokenEvent
from engine.model_config import ModelConfig
from engine.scheduler import Scheduler
from engine.spec.draft_model import DraftModel

PROMPTS = ["The cat sat on the mat. The dog sat on the", "1, 2, 3, 4, 5, 6,", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def smol(default_gguf_path):
    """The default model as target and as draft on the default backend (cpu; numpy where it does not build):
    what runs is the scheduler's and the draft model's logic, which is the backends' alike."""
    from engine.backends import create_backend
    from engine.loaders import load_artifact
    from engine.tokenizer import load_tokenizer

    target, draft = create_backend("cpu"), create_backend("cpu")
    cfg, weights = load_artifact(default_gguf_path, None, as_stored=getattr(target, "weights_as_stored", False))
    plan = target.load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=512)
    draft.load(cfg, weights, block_size=16, kv_budget_bytes=32 << 20, host_kv_budget_bytes=0, max_context=512)
    return target, plan, draft, load_tokenizer(default_gguf_path)


_plain: dict[str, tuple] = {}


def plain_run(target, plan, tok, sampling=None):
    """The output without a draft, once a module per sampling (two tests compare against the greedy one)."""
    key = repr(sampling)
    if key not in _plain:
        _plain[key] = generate(target, plan, tok, sampling=sampling)
    return _plain[key]


def generate(target, plan, tok, *, draft=None, rows=0, sampling=None, n=24):
    cfg = EngineConfig(decode_lanes=4, prefill_chunk=256, max_context=512, block_size=16,
                       spec_draft_model="draft" if draft else "")  # fmt: skip
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0), max_round_rows=rows,
                      draft_model=draft)  # fmt: skip
    for i, text in enumerate(PROMPTS):
        s = {**(sampling or {"temperature": 0}), "ignore_eos": True}
        assert (
            sched.add_request(AddRequest(f"p{i}", "c", tok.encode(text, add_special_tokens=True), n, sampling=s))
            is None
        )
    out = {f"p{i}": [] for i in range(len(PROMPTS))}
    rounds = 0
    while sched.has_work:
        step = sched.schedule()
        rounds += bool(step.decode)
        for o in sched.update_from_output(step, target.step(step)):
            if isinstance(o, TokenEvent):
                out[o.request_id] += o.token_ids
    return out, rounds, sched.make_stats()


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.8, "top_p": 0.95, "seed": 3}])
def test_the_model_as_its_own_draft_is_accepted_and_changes_nothing(smol, sampling):
    target, plan, draft_backend, tok = smol
    plain, rounds_plain, _ = plain_run(target, plan, tok, sampling)
    draft = DraftModel(draft_backend, num_blocks=64, block_size=16)
    spec, rounds_spec, stats = generate(target, plan, tok, draft=draft, rows=16, sampling=sampling)
    assert spec == plain
    drafted, accepted = stats.spec_drafted["draft_model"], stats.spec_accepted["draft_model"]
    if sampling is None:  # greedy drafts of the same weights: the target agrees (bar float ties)
        assert accepted >= 0.9 * drafted and rounds_spec < rounds_plain / 2
    assert not draft.shadows and draft.kv.usage()["used"] == 0  # every lane's draft cache went back


def test_a_poor_draft_costs_acceptance_not_correctness(smol, tmp_path, default_gguf_path):
    from engine.backends.numpy import NumpyBackend
    from engine.loaders import load_artifact
    from tests.models.tiny import write_tiny_llama

    target, plan, _, tok = smol
    cfg, weights = load_artifact(write_tiny_llama(tmp_path / "tiny", default_gguf_path))
    backend = NumpyBackend()
    backend.load(cfg, weights, block_size=16, kv_budget_bytes=8 << 20, host_kv_budget_bytes=0, max_context=512)
    plain, _, _ = plain_run(target, plan, tok)
    spec, _, stats = generate(target, plan, tok, draft=DraftModel(backend, num_blocks=8, block_size=16), rows=16)
    assert spec == plain
    assert stats.spec_accepted.get("draft_model", 0) < 0.5 * stats.spec_drafted["draft_model"]


def test_a_draft_model_with_another_vocabulary_is_refused():
    from engine.loading import load_draft

    target = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16)

    def loader(path, progress):
        return ModelConfig("llama", 120, 64, 128, 2, 4, 2, 16), {}

    with pytest.raises(ValueError, match="spec.draft_model: a vocabulary of 120 tokens"):
        load_draft(EngineConfig(spec_draft_model="x"), target, loader, lambda name, cfg: None)
