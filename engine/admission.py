"""Admission: whether a request runs, with what bound, or why it is refused.

Pure functions of the request, the configuration, the pool size and the
lanes in use, so the scheduler's queues stay out of it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from engine.config import EngineConfig
from engine.messages import AddRequest, RequestFailed
from engine.refusals import refusal
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def retry_after(holders: Iterable[Sequence], round_seconds: float | None, floor: float) -> float:
    """Seconds until the soonest expected lane release: the fewest remaining
    tokens among lane holders times the recent round time, at least ``floor``."""
    remaining = [s.num_remaining_tokens for s in holders]
    if not remaining or not round_seconds:
        return floor
    return max(floor, min(remaining) * round_seconds)


def admit(
    msg: AddRequest,
    cfg: EngineConfig,
    *,
    num_blocks: int,
    block_size: int,
    lane_holders: list[Sequence],
    round_seconds: float | None,
    seq_id: int,
    now: float,
    seed_rng: random.Random,
    supports_prompt_logprobs: bool = True,
    constraints=None,
    compiled=None,
) -> Sequence | RequestFailed:
    """Build the request's Sequence (with its grammar, if it names one), or the
    RequestFailed that refuses it. ``constraints`` is the load's
    engine.constraint.ConstraintFactory (None: grammars are refused);
    ``compiled`` the request's grammar already built off the event loop (a
    GrammarConstraint, or the reason it does not compile), else it is built here."""
    rid, num_prompt = msg.request_id, len(msg.prompt_token_ids)
    if msg.prompt_logprobs is not None and not supports_prompt_logprobs:
        return refusal("unsupported", rid)
    if num_prompt == 0:
        return refusal("invalid_prompt", rid)
    limit = cfg.max_context
    # A decide request needs only its prompt; anything else room for one token.
    if num_prompt > limit or (num_prompt == limit and not msg.decide):
        return refusal(
            "context_length_exceeded",
            rid,
            f"This model's maximum context length is {limit} tokens, "
            f"but the prompt has {num_prompt} tokens (with no room left to generate).",
        )
    requested = msg.max_tokens if msg.max_tokens and msg.max_tokens > 0 else cfg.default_max_tokens
    max_tokens = 0 if msg.decide else min(requested, limit - num_prompt)
    bound = num_prompt + max_tokens  # KV bound, never above max_context
    if -(-bound // block_size) > num_blocks:
        return refusal(
            "context_length_exceeded",
            rid,
            f"The request needs {bound} tokens of KV cache ({num_prompt} prompt + {max_tokens} to generate), "
            f"more than the pool holds ({num_blocks * block_size} tokens); lower max_tokens or the prompt.",
        )
    if not msg.decide and len(lane_holders) >= cfg.decode_lanes:
        return refusal(
            "engine_full",
            rid,
            f"All {cfg.decode_lanes} decode lanes are busy; retry shortly.",
            retry_after=retry_after(lane_holders, round_seconds, cfg.retry_after_floor),
        )
    sampling = SamplingParams.from_dict(msg.sampling or {})
    seed = sampling.seed if sampling.seed is not None else seed_rng.getrandbits(63)
    seq = Sequence(
        seq_id=seq_id,
        request_id=rid,
        prompt_token_ids=list(msg.prompt_token_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        stop_token_ids=frozenset(() if sampling.ignore_eos else msg.stop_token_ids or ()),
        request_class=msg.request_class or "interactive",
        num_logprobs=msg.num_logprobs,
        want_logprobs=msg.want_logprobs or msg.num_logprobs > 0,
        is_decide=msg.decide,
        shared_prefix_len=min(max(msg.shared_prefix_len, 0), num_prompt),
        prompt_logprobs=msg.prompt_logprobs,
        decide_token_ids=list(msg.decide_token_ids) if msg.decide_token_ids is not None else None,
        arrival_time=now,
    )
    if msg.grammar:
        problem = compiled if isinstance(compiled, str) else None
        if compiled is not None and problem is None:
            seq.constraint = compiled
        elif compiled is None:
            problem = _attach_constraint(seq, msg.grammar, constraints)
        if problem is not None:
            return refusal("invalid_grammar", rid, problem)
    return seq


def _attach_constraint(seq: Sequence, grammar: str, constraints) -> str | None:
    """Give ``seq`` its grammar (engine.constraint), or say why it cannot have one."""
    built = compile_grammar(grammar, sorted(seq.stop_token_ids), constraints)
    if isinstance(built, str):
        return built
    seq.constraint = built
    return None


def compile_grammar(grammar: str, stop_token_ids: list[int], constraints):
    """A GrammarConstraint for ``grammar``, or the reason there is none. Compiling takes
    milliseconds to seconds (and the first one loads the tokenizer): the worker runs it
    off the event loop and hands the result to ``admit`` as ``compiled``."""
    from engine.constraint import ConstraintError

    if constraints is None:
        return "Constrained decoding is not available on this engine."
    try:
        return constraints.build(grammar, stop_token_ids)
    except (ConstraintError, ImportError, ValueError) as exc:
        return f"The output grammar does not compile: {exc}"
