"""/v1/decide's answer from the engine's label logprobs equals the answer from the whole logits row."""

from __future__ import annotations

import math

import numpy as np

from apps.api.decide import PreparedDecision, decision_render
from engine.messages import AddRequest
from engine.sampler import log_softmax


def test_label_logprobs_give_the_same_decision_as_the_whole_row():
    rng = np.random.default_rng(0)
    logits = (rng.normal(0, 3, 49152)).astype(np.float32)
    label_tokens = [[17, 400], [9000], [49151, 3]]
    ids = sorted({t for toks in label_tokens for t in toks})
    add = AddRequest("decision-x", "", [1, 2], 0, decide=True, decide_token_ids=ids)
    prep = PreparedDecision(served=type("S", (), {"served_id": "m"})(), add=add, labels=["a", "b", "c"],
                            label_tokens=label_tokens)  # fmt: skip
    whole = decision_render(prep, [float(x) for x in logits], 12, 4)
    lp = log_softmax(logits)  # what the engine computes for decide_token_ids
    some = decision_render(prep, None, 12, 4, {t: float(lp[t]) for t in ids})
    for d in (whole, some):
        d.pop("created")
    assert some["label"] == whole["label"] and some["usage"] == whole["usage"]
    assert math.isclose(some["label_mass"], whole["label_mass"], rel_tol=1e-9)
    for a, b in zip(some["distribution"], whole["distribution"]):
        assert a["label"] == b["label"] and math.isclose(a["probability"], b["probability"], rel_tol=1e-9)
