"""spec.cost_aware: the round's cost by its rows (engine/spec/cost.py) and the drafts kept for it,
alone and through the scheduler on a fake backend whose round time grows with its rows."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import TokenEvent
from engine.scheduler import Scheduler
from engine.spec.cost import RoundCost, plan_drafts
from tests.engine.fake_backend import FakeClock
from tests.engine.test_spec_rounds import LoopyBackend, requests


def known(costs: dict[int, float]) -> RoundCost:
    c = RoundCost(alpha=1.0)
    for rows, s in costs.items():
        c.observe(rows, s)
    return c


def test_cost_is_as_seen_between_row_counts_and_unknown_outside():
    c = known({4: 1.0, 12: 3.0})
    assert c.estimate(4) == 1.0 and c.estimate(8) == pytest.approx(2.0) and c.estimate(12) == 3.0
    assert c.estimate(3) is None and c.estimate(13) is None
    c2 = RoundCost(alpha=0.5)
    c2.observe(4, 1.0)
    c2.observe(4, 3.0)
    c2.observe(5, 0.0)  # a round that reported no time teaches nothing
    assert c2.estimate(4) == 2.0 and c2.estimate(5) is None


def test_flat_cost_keeps_every_draft():
    """A round bound by streaming the weights: rows cost nothing, so every draft asked for stays."""
    assert plan_drafts([0.9, 0.3, 0.0], [4, 2, 1], 3, known({3: 1.0, 10: 1.0})) == [4, 2, 1]


def test_rows_at_a_plain_round_each_keep_no_draft():
    """Rows cost as much as the lanes' own rows: a draft (worth under one token) never pays."""
    assert plan_drafts([0.9, 0.5], [8, 8], 2, known({2: 2.0, 18: 18.0})) == [0, 0]


def test_the_surest_drafts_are_kept_first():
    # 4 lanes; 8 more rows cost 20% more, 16 more double the round: the first drafts of the lanes
    # that accept most are worth it, the rest are not.
    cost = known({4: 1.0, 12: 1.2, 20: 2.0})
    keep = plan_drafts([0.9, 0.9, 0.2, 0.2], [4, 4, 4, 4], 4, cost)
    assert keep[0] == keep[1] > 0 and keep[2] == keep[3] == 0
    tokens = 4 + sum(0.9**j for j in range(1, keep[0] + 1)) * 2
    assert tokens / cost.estimate(4 + sum(keep)) > 4 / 1.0  # better than no drafts


def test_unknown_costs_keep_the_drafts_asked_for():
    assert plan_drafts([0.5], [6], 1, RoundCost()) == [6]
    assert plan_drafts([0.5], [6], 1, known({1: 1.0, 4: 2.0})) == [6]  # rows 5..7 not known: 7 teaches them


def test_a_probe_round_comes_while_the_plain_cost_is_unknown():
    c = RoundCost(probe_every=3)
    assert [c.probe(2) for _ in range(6)] == [False, False, True, False, False, True]
    c.observe(2, 1.0)
    assert not any(c.probe(2) for _ in range(6))


class RowCostBackend(LoopyBackend):
    """A round takes ``per_row`` seconds a row (an arithmetic-bound backend) or ``flat`` seconds."""

    def __init__(self, *a, per_row: float = 0.0, flat: float = 0.0, **kw) -> None:
        super().__init__(*a, **kw)
        self.per_row, self.flat, self.busy = per_row, flat, 0.0

    def step(self, plan, *, defer=False):
        out = super().step(plan, defer=defer)
        if plan.decode:
            out.decode_seconds = self.flat + self.per_row * len(plan.decode)
            self.busy += out.decode_seconds
        return out


def run(cost_aware: bool, rows: int = 16, **costs):
    cfg = EngineConfig(decode_lanes=4, prefill_chunk=16, max_context=512, block_size=4, default_max_tokens=16,
                       spec_cost_aware=cost_aware)  # fmt: skip
    sched = Scheduler(cfg, KVManager(128, 4, 0), clock=FakeClock(), seed_rng=random.Random(0), max_round_rows=rows)
    sched.round_cost = RoundCost(probe_every=4)
    backend = RowCostBackend(128, 4, 0, **costs)
    backend.load(None, {}, block_size=4, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=512)
    reqs = requests(4, max_tokens=120)
    for r in reqs:
        assert sched.add_request(r) is None
    tokens = {r.request_id: [] for r in reqs}
    drafted = 0
    while sched.has_work:
        plan = sched.schedule()
        drafted += sum(len(d) for d in plan.drafts.values())
        for out in sched.update_from_output(plan, backend.step(plan)):
            if isinstance(out, TokenEvent):
                tokens[out.request_id] += out.token_ids
    return tokens, drafted, backend.busy, sched.make_stats().spec_trimmed


def test_rows_that_cost_their_time_stop_the_drafting_and_the_tokens_stay():
    plain, _, t_plain, _ = run(False, rows=0, per_row=1e-3)
    spec, d_spec, t_spec, trimmed_off = run(False, per_row=1e-3)
    aware, d_aware, t_aware, trimmed = run(True, per_row=1e-3)
    assert spec == plain and aware == plain  # lossless either way
    assert d_aware < d_spec / 2  # once the costs are seen, drafting stops paying
    assert t_aware < t_spec
    assert trimmed_off == 0 and trimmed >= d_spec / 2  # ignis_spec_trimmed_drafts_total


def test_free_rows_keep_every_draft():
    spec, d_spec, t_spec, _ = run(False, flat=1e-3)
    aware, d_aware, t_aware, _ = run(True, flat=1e-3)
    assert aware == spec and d_aware >= d_spec * 0.9  # only the probe rounds go without
    assert t_aware <= t_spec * 1.1
