"""Speculation as the scheduler runs it: drafts into rows, rows back into committed tokens.

``lane_rows`` turns a decoding sequence and its drafts into the round's rows
(its known tokens not yet fed, usually just the last one, and each draft at
consecutive positions, each row's sampling request counting the drafts before
it); ``accepted`` turns the rows' sampled tokens back into the tokens to
commit. A lane is more than one token behind after a take-back (the forced
end of its thinking, engine/spec/reasoning.py): those rows feed known tokens
exactly as accepted drafts would have been fed, and only the row of the last
known token samples. ``attach_drafter`` gives a new sequence its drafter at
admission: the request's ``prediction`` when it has one, else prompt lookup;
never for a grammar-constrained or decide request; ``reattach_drafter``
rebuilds it after a take-back cut the output.
"""

from __future__ import annotations

from engine.backend import DecodeLane
from engine.config import EngineConfig
from engine.sequence import Sequence
from engine.spec.adaptive import AdaptiveK
from engine.spec.draft_model import DraftProposer
from engine.spec.drafters import PredictionDrafter, PromptLookup
from engine.spec.verify import accept_sampled


def attach_drafter(seq: Sequence, cfg: EngineConfig, prediction_token_ids: list[int] | None) -> None:
    """Give ``seq`` a drafter fed with its prompt (none for constrained or decide requests)."""
    if seq.is_decide or seq.constraint is not None:
        return
    lookup = PromptLookup(min_n=min(2, cfg.spec_ngram), max_n=max(1, cfg.spec_ngram))
    if prediction_token_ids:
        seq.drafter = PredictionDrafter(prediction_token_ids, prompt_len=seq.num_prompt_tokens, fallback=lookup)
    elif cfg.spec_draft_model:
        seq.drafter = DraftProposer()  # the scheduler's DraftModel drafts for it, batched
    else:
        seq.drafter = lookup
    seq.drafter.commit(seq.prompt_token_ids)
    seq.drafter.commit(seq.output_token_ids)  # a recompute keeps its output
    seq.k_control = AdaptiveK(max_k=cfg.spec_max_draft)


def reattach_drafter(seq: Sequence, cfg: EngineConfig) -> None:
    """A take-back cut the output: the drafter's index would still hold the tokens taken back."""
    if seq.drafter is None:
        return
    k_control = seq.k_control
    prediction = getattr(seq.drafter, "prediction", None)
    attach_drafter(seq, cfg, prediction)
    seq.k_control = k_control


def k_for(seq: Sequence, budget: int) -> int:
    """How many drafts ``seq`` asks for this round (at most ``budget``, none past its max_tokens)."""
    if seq.drafter is None or budget <= 0:
        return 0
    room = min(budget, seq.num_remaining_tokens - 1, seq.k_control.max_k)
    return seq.k_control.next_k(room) if room > 0 else 0


def drafts_for(seq: Sequence, budget: int) -> list[int]:
    """The drafts ``seq`` proposes this round: at most ``budget``, none past its max_tokens."""
    if seq.drafter is None or budget <= 0:
        return []
    room = min(budget, seq.num_remaining_tokens - 1)  # the round commits one more than it keeps
    offered = seq.drafter.propose(min(room, seq.k_control.max_k)) if room > 0 else []
    k = seq.k_control.next_k(len(offered))
    return offered[:k]


def num_behind(seq: Sequence) -> int:
    """Known tokens before the last one whose K/V are not written (forced tokens after a take-back)."""
    return max(0, seq.num_tokens - 1 - seq.num_computed_tokens)


def lane_rows(seq: Sequence, drafts: list[int], num_known: int = 1) -> list[DecodeLane]:
    """The rows of ``seq``'s lane: ``num_known`` known tokens from its first position without K/V
    (1: its last token), then each draft, at consecutive positions. Drafts follow only when the
    known rows reach the last token."""
    start = seq.num_tokens - 1 - num_behind(seq)
    tokens = seq.token_ids_at(start, start + num_known) + list(drafts)
    table = list(seq.block_table)
    first_draft = seq.num_tokens - start  # rows from here on verify drafts
    return [
        DecodeLane(seq.seq_id, t, start + j, table, seq.sample_request(drafts[: max(0, j + 1 - first_draft)]))
        for j, t in enumerate(tokens)
    ]


def accepted(seq: Sequence, drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens ``seq`` commits from its rows' samples; the k controller and, for drafts from the
    request's prediction, its counters learn."""
    if not drafts:
        return list(sampled)
    kept = accept_sampled(drafts, sampled)
    seq.num_spec_drafted += len(drafts)
    seq.num_spec_accepted += len(kept) - 1
    if source(seq) == "prediction":
        seq.num_drafted += len(drafts)
        seq.num_accepted += len(kept) - 1
    seq.k_control.update(len(drafts), len(kept) - 1)
    return kept


def source(seq: Sequence) -> str:
    """Which drafter proposed ``seq``'s last drafts (a prediction falls back to prompt lookup)."""
    return getattr(seq.drafter, "source", seq.drafter.name)
