"""Rounds planned ahead: round N+1 is planned while round N computes (issue 15, point 2).

The worker (engine/worker.py ``_run_rounds``) hands round N to the step thread,
then asks ``plan_ahead(sched, plan_N)`` for round N+1 and hands that over too, so
the backend starts it the moment N ends; only then does it turn N's output into
events. A lane's row in N+1 feeds ``PENDING``, "the token this lane drew in
round N", which the backend keeps (Backend.last_tokens) and the host learns from
N's output a round later.

The books count the pending token: each lane's table grows to hold the position
it feeds (its known tokens plus one), exactly what the synchronous schedule gives
it once N's token is known. When N's output shows a lane finished (a stop token,
an abort meanwhile), the scheduler frees the lane with that page, as it frees
everything a finished lane held, and ignores its N+1 row (update_from_output
skips rows of sequences no longer live). The row's K/V write lands in a page no
live sequence reads before it is written again: the position is one past a
finished lane's output, never in a full prompt block (the only ones the prefix
cache hashes and keeps).

A lane whose round N commits its last token by length is known ahead: it gets no
row. A round runs ahead only when every other decoding lane can; otherwise the
worker plans it after N's output, as before (``None``):

* round N must be a plain decode round: no prefill span, no swaps, no drafts, and
  nothing waiting, prefilling or preempted (admission and the prefill gate stay
  the synchronous schedule's);
* each lane fed its last known token in N, one row, and needs nothing of N's token
  on the host: no grammar, no reasoning channel open (inside it, or entering it with
  the budget spent, a commit may take back: the output is cut), no
  repetition / presence / frequency penalty, no speculation (spec.enabled, a
  drafter, and rows to spare in the round for drafts: drafts extend the token the
  host does not know yet), no prompt tail fed as rows;
* free pages (holding nothing: no retained prefix is evicted for a row that may be
  thrown away) cover every lane's next position, and no page is released behind a
  sliding window (kv_window).

Positions, seeds and the sampling request (``min_tokens`` counts the pending
token) are the ones the synchronous schedule would give, so tokens are the same
with rounds planned ahead or not.
"""

from __future__ import annotations

from engine.backend import PENDING, DecodeLane, StepPlan
from engine.sequence import Sequence, SequenceStatus

S = SequenceStatus


def can_run_ahead(seq: Sequence, speculates: bool) -> bool:
    """Whether ``seq``'s next row can be planned before its last round's token is known
    (``speculates``: the round has rows to spare for drafts, and speculation is on)."""
    p = seq.sampling
    return (
        seq.status == S.DECODING
        and not seq.prompt_in_round
        and seq.constraint is None
        and takes_nothing_back(seq.reasoning)
        and not (speculates and seq.drafter is not None)
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


def takes_nothing_back(watch) -> bool:
    """Whether the lane's next commit cannot take back (engine.spec.reasoning.ReasoningWatch.commit):
    no watch, or one outside the reasoning channel with budget left (entering it then takes nothing
    back; inside, a loop or the budget may)."""
    return watch is None or (not watch.inside and (watch.budget is None or watch.count < watch.budget))


def plan_ahead(sched, plan: StepPlan) -> StepPlan | None:
    """Round N+1 while ``plan`` (round N) runs; None: plan it once N's output is in (see module doc)."""
    if plan.prefill is not None or plan.swap_out or plan.swap_in or plan.drafts or not plan.decode:
        return None
    if sched.waiting or sched.prefilling is not None or sched.preempted or sched.kv_window is not None:
        return None
    fed = {}  # seq_id -> position its one row in N feeds
    for lane in plan.decode:
        if lane.seq_id in fed:
            return None
        fed[lane.seq_id] = lane.position
    cfg = sched.cfg
    speculates = cfg.spec_enabled and cfg.spec_max_draft > 0 and sched.max_draft_rows > len(sched.running)
    kv = sched.kv
    lanes: list[Sequence] = []
    need = 0
    for seq in sched.running:
        if fed.get(seq.seq_id) != seq.num_tokens - 1 or not can_run_ahead(seq, speculates):
            return None
        if seq.num_generated + 1 >= seq.max_tokens:
            continue  # N commits its last token: it finishes there
        need += max(0, kv.blocks_for(seq.num_tokens + 1) - len(seq.block_table))
        lanes.append(seq)
    if not lanes or need > kv.num_free_blocks:
        return None
    ahead = StepPlan()
    for seq in lanes:
        kv.append_slots(seq, seq.num_tokens + 1)  # the position the pending token is fed at
        ahead.decode.append(
            DecodeLane(
                seq_id=seq.seq_id,
                token_id=PENDING,
                position=seq.num_tokens,
                block_table=list(seq.block_table),
                sample=seq.sample_request(drafts=(PENDING,)),  # one more output token (min_tokens)
                rope_delta=seq.rope_delta,
            )
        )
    return ahead


def fill_known(sched, plan: StepPlan) -> StepPlan:
    """``plan`` with each PENDING row's token read from its live sequence (N's output is in), and the
    rows of sequences that finished meanwhile left out: what running its rows again needs."""
    rows = []
    for lane in plan.decode:
        seq = sched.sequence(lane.seq_id)
        if seq is None or seq.status != S.DECODING or seq.num_tokens <= lane.position:
            continue
        if lane.token_id == PENDING:
            lane.token_id = seq.token_ids_at(lane.position, lane.position + 1)[0]
        rows.append(lane)
    plan.decode = rows
    return plan
