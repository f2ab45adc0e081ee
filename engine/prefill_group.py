"""Prompts prefilled together: which waiting prompts join the step of the one taking the prefill lane.

Issue 15 point 4: prompts that arrive together and fit one chunk together prefill in one step,
so a burst of subagents does not queue behind each other's prefills. ``join(sched, lead_tokens)``
runs when a prompt takes the lane (Scheduler._start_prefill) and prefills whole in its first
chunk: the waiting prompts next in rank order join it (``sched.joined``, PREFILLING) while

* each fits whole in what is left of ``cfg.prefill_chunk`` (a prompt is never split across a
  group: one that does not fit ends the group and leads the next one, or prefills alone);
* its pages are free without preempting anyone, and no better-ranked preempted lane waits;
* it is plain (no images, prompt scoring or decide: those prefill alone, the lead too);
* its next block after the prefix it can claim now is not one the group computes: a burst
  sharing a system prompt claims those blocks a step later, as without groups, instead of
  computing them again beside the first one.

The first prompt that does not qualify ends the group: none jumps another. The members' spans
run in the lead's step (``StepPlan.prefill_more``), each with its own positions, block table and
sample request, and the decode-share gate counts the group's tokens (the caller adds what
``join`` returns to the lead's first chunk). ``cfg.prefill_group`` off, or a backend that would run
the spans one by one anyway (``Backend.prefills_together`` False; the numpy, cpu and cuda backends
run a group in one forward), nobody joins: there a group would only hold its first prompts' first
tokens until the last span ran.
"""

from __future__ import annotations

from engine.sequence import Sequence, SequenceStatus


def plain(seq: Sequence) -> bool:
    """Whether ``seq`` may prefill in a group: no images, prompt scoring or decide."""
    return not (seq.images or seq.prompt_logprobs is not None or seq.is_decide)


def join(sched, lead_tokens: int) -> int:
    """Waiting prompts join the step of ``sched.prefilling``, which just took the lane with a first
    chunk of ``lead_tokens`` (see the module doc); returns the tokens that joined."""
    lead, kv = sched.prefilling, sched.kv
    budget = sched.cfg.prefill_chunk - lead_tokens
    if (
        not (sched.cfg.prefill_group and sched.groups_prefill)
        or lead.num_computed_tokens + lead_tokens < lead.num_tokens
        or not plain(lead)
    ):
        return 0
    joined = 0
    while sched.waiting and budget > 0:
        seq = sched.waiting[0]
        if not plain(seq) or (sched.preempted and sched.preempted[0].rank < seq.rank):
            break
        claimable = kv.num_claimable_tokens(seq)
        if seq.num_tokens - claimable > budget or not kv.can_allocate(0, seq):
            break
        if _shares_a_block(seq, claimable, [lead, *sched.joined], kv.block_size):
            break
        sched.waiting.pop(0)
        kv.allocate(seq)
        seq.status = SequenceStatus.PREFILLING
        sched.joined.append(seq)
        tail = seq.num_tokens - seq.num_computed_tokens
        budget -= tail
        joined += tail
    return joined


def _shares_a_block(seq: Sequence, start: int, group: list[Sequence], block_size: int) -> bool:
    """Whether ``seq``'s prompt up to the end of its full block at ``start`` is the same tokens in a
    prompt of ``group``."""
    end = start + block_size
    if end > seq.num_prompt_tokens:
        return False
    head = seq.prompt_token_ids[:end]
    return any(m.prompt_token_ids[:end] == head for m in group)
