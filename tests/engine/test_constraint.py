"""Constrained decoding: the sampler's mask keeps any logits inside the grammar."""

from __future__ import annotations

import json

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")

from engine.backend import SampleRequest  # noqa: E402
from engine.constraint import ConstraintError, ConstraintFactory  # noqa: E402
from engine.sampler import sample_row  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def factory(default_gguf_path):
    f = ConstraintFactory(default_gguf_path)
    f.warm()
    return f


def _generate(factory, grammar: str, seed: int, params: SamplingParams) -> str:
    from engine.tokenizer import load_tokenizer

    con = factory.build(grammar, [2])
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for pos in range(200):
        logits = rng.standard_normal(con.vocab_size).astype(np.float32) * 3
        logits[2] -= 10  # the stop token is unlikely: only the grammar's end may force it
        req = SampleRequest(params=params, seed=seed, output_token_ids=out, constraint=con, want_logprobs=True)
        token, lp = sample_row(logits, req, pos)
        assert np.isfinite(lp.logprob) and all(np.isfinite(v) for _, v in lp.top)
        if token == 2:
            break
        con.consume(token)
        out.append(token)
    bundle = load_tokenizer(factory.artifact_path)
    return bundle.decode(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_still_produce_schema_json(factory, seed, temperature):
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {**SCHEMA, "properties": {"n": {"type": "integer", "maximum": 999, "minimum": 0}, "ok": {"type": "boolean"}}},
        defaults={"whitespace_flexible": False},
    )
    text = _generate(factory, grammar, seed, SamplingParams(temperature=temperature))
    value = json.loads(text)
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)


def test_bad_grammar_is_refused(factory):
    with pytest.raises(ConstraintError):
        factory.build(llguidance.LLMatcher.grammar_from_json_schema({"type": "bogus"}), [2])


def test_scheduler_refuses_a_grammar_without_a_factory():
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest
    from engine.scheduler import Scheduler

    sched = Scheduler(EngineConfig(), KVManager(64, 16, 0))
    refused = sched.add_request(AddRequest("r1", "reply", [1, 2, 3], 4, grammar="{}"))
    assert refused is not None and refused.code == "invalid_grammar" and refused.status == 400
    assert sched.make_stats().lanes_busy == 0
