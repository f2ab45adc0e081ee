"""Short prompts fed as rows of the decode round (model.short_prefill, Scheduler._admit_short):
no prefill pass, a burst starts in one round, and the tokens are those of a prefilled run."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.messages import TokenEvent
from engine.scheduler import Scheduler
from tests.engine.fake_backend import FakeBackend, FakeClock, create_requests, run_until_done, step, tokens_of
from tests.engine.test_scheduler import assert_pool_drained, expected_tokens


def scheduler(*, short_prefill: int = 16, rows: int = 16, block_size: int = 4, lanes: int = 4, spec: bool = False,
              draft_rows: int = 0):  # fmt: skip
    cfg = EngineConfig(decode_lanes=lanes, prefill_chunk=64, max_context=256, block_size=block_size,
                       default_max_tokens=16, short_prefill=short_prefill, spec_enabled=spec)  # fmt: skip
    clock = FakeClock()
    sched = Scheduler(cfg, KVManager(64, block_size, 16), clock=clock, seed_rng=random.Random(0), max_round_rows=rows,
                      max_draft_rows=draft_rows)  # fmt: skip
    return sched, FakeBackend(64, block_size, 16), clock


def test_a_burst_of_short_prompts_starts_in_one_round_without_a_prefill():
    sched, backend, clock = scheduler()
    reqs = create_requests(4, prompt_len=3, max_tokens=5)
    for r in reqs:
        assert sched.add_request(r) is None
    first = sched.schedule()
    assert first.prefill is None
    assert [ln.seq_id for ln in first.decode] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # each prompt's 3 rows
    outs = sched.update_from_output(first, backend.step(first))
    events = [o for o in outs if isinstance(o, TokenEvent)]
    assert len(events) == 4 and all(e.ttft is not None for e in events)  # every first token in that round
    msgs = run_until_done(sched, backend, clock)
    for r, e in zip(reqs, events):
        assert e.token_ids + tokens_of(msgs[r.request_id]) == expected_tokens(r, 5)
    assert sched.make_stats().prefilled_tokens == 12
    assert_pool_drained(sched)


def test_a_long_prompt_prefills_and_a_short_one_rides_the_round_beside_it():
    sched, backend, clock = scheduler()
    long, short = create_requests(2, prompt_len=40, max_tokens=4)[0], create_requests(1, prompt_len=6, start=5)[0]
    for r in (long, short):
        assert sched.add_request(r) is None
    plan = sched.schedule()
    assert plan.prefill is not None and plan.prefill.seq_id == 0  # the long one prefills (its rank first)
    assert {ln.seq_id for ln in plan.decode} == {1}  # the short one's rows are the round
    msgs = run_until_done(sched, backend, clock)
    for r in (long, short):
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, r.max_tokens)


def test_a_second_turn_over_a_retained_prefix_is_short():
    sched, backend, clock = scheduler()
    (turn1,) = create_requests(1, prompt_len=40, max_tokens=4)
    assert sched.add_request(turn1) is None
    out1 = tokens_of(run_until_done(sched, backend, clock)[turn1.request_id])
    (turn2,) = create_requests(1, prompt_len=50, max_tokens=4, prefix=turn1.prompt_token_ids + out1, start=9)
    assert sched.add_request(turn2) is None
    plan = sched.schedule()
    assert plan.prefill is None  # turn 1's 40 prompt tokens are retained blocks: a tail of 10 rows
    assert len(plan.decode) == 50 - 40
    outs = sched.update_from_output(plan, backend.step(plan))
    msgs = run_until_done(sched, backend, clock)
    assert tokens_of(outs) + tokens_of(msgs[turn2.request_id]) == expected_tokens(turn2, 4)


@pytest.mark.parametrize("short_prefill, rows", [(0, 16), (16, 1)])
def test_off_or_one_row_a_lane_prefills_as_before(short_prefill, rows):
    sched, backend, clock = scheduler(short_prefill=short_prefill, rows=rows)
    (r,) = create_requests(1, prompt_len=3)
    assert sched.add_request(r) is None
    assert sched.schedule().prefill is not None


def test_a_tail_longer_than_the_spare_rows_is_fed_over_rounds_better_ranked_first():
    sched, backend, clock = scheduler(rows=6)
    reqs = create_requests(2, prompt_len=9, max_tokens=3)
    for r in reqs:
        assert sched.add_request(r) is None
    plan = sched.schedule()
    assert len(plan.decode) == 6  # 2 lanes: 1 row each plus the 4 spare, to the better-ranked first
    assert [ln.seq_id for ln in plan.decode].count(0) == 5
    msgs = {}
    for o in sched.update_from_output(plan, backend.step(plan)):
        msgs.setdefault(o.request_id, []).append(o)
    assert not msgs  # no prompt is fed to its end yet
    for rid, outs in run_until_done(sched, backend, clock).items():
        msgs.setdefault(rid, []).extend(outs)
    for r in reqs:
        assert tokens_of(msgs[r.request_id]) == expected_tokens(r, 3)


def test_the_path_depends_on_the_request_not_on_what_shares_the_round():
    alone, backend, clock = scheduler()
    (r,) = create_requests(1, prompt_len=5, start=3)
    alone.add_request(r)
    assert alone.schedule().prefill is None
    busy, backend2, clock2 = scheduler()
    for other in create_requests(3, prompt_len=12, max_tokens=30):
        busy.add_request(other)
    for _ in range(3):
        step(busy, backend2, clock2)
    busy.add_request(r)
    plan = busy.schedule()
    assert plan.prefill is None and r.request_id in {s.request_id for s in busy.running}


def test_known_rows_are_owed_before_drafts(monkeypatch):
    from engine.spec import rounds

    sched, backend, clock = scheduler(rows=8, spec=True)
    (first,) = create_requests(1, prompt_len=40, max_tokens=20)
    sched.add_request(first)
    for _ in range(3):
        step(sched, backend, clock)  # prefilled, decoding
    monkeypatch.setattr(rounds, "drafts_for", lambda seq, budget: [7] * budget)  # a lane always drafting
    (short,) = create_requests(1, prompt_len=5, start=4)
    sched.add_request(short)
    plan = sched.schedule()
    seqs = [ln.seq_id for ln in plan.decode]
    assert seqs.count(1) == 5  # the new prompt's whole tail, though the better-ranked lane could draft
    assert plan.drafts[0] == [7] * (8 - 5 - 1)  # the drafting lane gets what is left


def test_a_burst_past_the_draft_rows_starts_in_one_wider_round(monkeypatch):
    """Backend.max_draft_rows (cuda.round_rows) below max_round_rows (cuda.known_rows): the known rows of a
    burst of short prompts fill the wide round, drafts never bring a round past the draft rows."""
    from engine.spec import rounds

    sched, backend, clock = scheduler(rows=32, draft_rows=8, lanes=4, spec=True)
    reqs = create_requests(4, prompt_len=7, max_tokens=6)
    for r in reqs:
        assert sched.add_request(r) is None
    first = sched.schedule()
    assert first.prefill is None and len(first.decode) == 28  # every tail in one round, past the 8 draft rows
    assert not first.drafts
    outs = sched.update_from_output(first, backend.step(first))
    assert len([o for o in outs if isinstance(o, TokenEvent)]) == 4  # every first token in that round
    monkeypatch.setattr(rounds, "drafts_for", lambda seq, budget: [7] * budget)  # lanes always drafting
    plan = sched.schedule()
    assert len(plan.decode) == 8 and sum(map(len, plan.drafts.values())) == 8 - 4  # drafts stop at the 8


def test_draft_rows_default_to_the_round_rows():
    sched, _, _ = scheduler(rows=12)
    assert sched.max_draft_rows == 12
    assert scheduler(rows=12, draft_rows=20)[0].max_draft_rows == 12  # never past the round's rows


@pytest.fixture(scope="module")
def real_model(default_gguf_path):
    """The default GGUF on the default backend (cpu; numpy where its kernels do not build)."""
    from engine.backends import create_backend
    from engine.loaders import load_artifact
    from engine.tokenizer import load_tokenizer

    backend = create_backend("cpu", EngineConfig(backend="cpu"))
    as_stored = {"as_stored": True} if getattr(backend, "weights_as_stored", False) else {}
    cfg, weights = load_artifact(default_gguf_path, None, **as_stored)
    plan = backend.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0,
                        max_context=512)  # fmt: skip
    return backend, plan, load_tokenizer(default_gguf_path)


def generate_real(real_model, prompts: list[str], short_prefill: int, tokens: int = 24) -> tuple[dict, int]:
    from engine.messages import AddRequest

    backend, plan, tok = real_model
    cfg = EngineConfig(decode_lanes=4, prefill_chunk=256, max_context=512, block_size=16, short_prefill=short_prefill)
    sched = Scheduler(cfg, KVManager(plan.num_blocks, 16, 0), seed_rng=random.Random(0),
                      max_round_rows=backend.max_round_rows)  # fmt: skip
    for i, text in enumerate(prompts):
        ids = tok.encode(text, add_special_tokens=True)
        assert (
            sched.add_request(AddRequest(f"p{i}", "c", ids, tokens, sampling={"temperature": 0, "ignore_eos": True}))
            is None
        )
    out: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    prefills = 0
    while sched.has_work:
        p = sched.schedule()
        prefills += len(p.prefills)  # spans: a group prefills several prompts in one step
        for o in sched.update_from_output(p, backend.step(p)):
            if isinstance(o, TokenEvent):
                out[o.request_id] += o.token_ids
    return out, prefills


SHORT = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def main():"]


def test_short_prompts_on_the_real_model_give_the_prefilled_tokens(real_model):
    rows, prefills_rows = generate_real(real_model, SHORT, short_prefill=16)
    plain, prefills_plain = generate_real(real_model, SHORT, short_prefill=0)
    assert (prefills_rows, prefills_plain) == (0, len(SHORT))  # every prompt fed as rows, or prefilled
    assert rows == plain
    alone, _ = generate_real(real_model, SHORT[:1], short_prefill=16)
    assert alone["p0"] == rows["p0"]  # the same beside three others in its rounds


def test_cuda_known_rows_key_reaches_cuda_tuning():
    from engine.config import CudaTuning
    from ignis_site import config

    # the server serves with 64; a backend built directly keeps 0 (engine/config.py says why)
    assert config.FIELDS["cuda.known_rows"].default == 64 and CudaTuning().known_rows == 0
    values, _ = config.resolve(environ={})
    assert CudaTuning(**config.cuda_tuning_dict(values)).known_rows == 64
    values, _ = config.resolve(environ={"IGNIS_CUDA_KNOWN_ROWS": "48"})
    assert CudaTuning(**config.cuda_tuning_dict(values)).known_rows == 48
    with pytest.raises(Exception, match="known_rows"):
        config.resolve(environ={"IGNIS_CUDA_KNOWN_ROWS": "65"})
