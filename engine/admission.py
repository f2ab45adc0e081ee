"""Admission: whether a request runs, with what bound, or why it is refused.

Pure functions of the request, the configuration, the pool size and the
lanes in use, so the scheduler's queues stay out of it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from engine.config import EngineConfig
from engine.messages import AddRequest, RequestFailed
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def context_error(msg: AddRequest, text: str) -> RequestFailed:
    return RequestFailed(
        request_id=msg.request_id,
        message=text,
        code="context_length_exceeded",
        status=400,
        error_type="invalid_request_error",
        param="messages",
    )


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
    lanes_busy: int,
    round_seconds: float | None,
    lane_holders: Iterable[Sequence],
    seq_id: int,
    now: float,
    seed_rng: random.Random,
) -> Sequence | RequestFailed:
    """Build the request's Sequence, or the RequestFailed that refuses it."""
    num_prompt = len(msg.prompt_token_ids)
    if num_prompt == 0:
        return RequestFailed(
            request_id=msg.request_id,
            message="The prompt is empty.",
            code="invalid_prompt",
            status=400,
            error_type="invalid_request_error",
            param="messages",
        )
    limit = cfg.max_context
    # A decide request needs only its prompt; anything else room for one token.
    if num_prompt > limit or (num_prompt == limit and not msg.decide):
        return context_error(
            msg,
            f"This model's maximum context length is {limit} tokens, "
            f"but the prompt has {num_prompt} tokens (with no room left to generate).",
        )
    requested = msg.max_tokens if msg.max_tokens and msg.max_tokens > 0 else cfg.default_max_tokens
    max_tokens = 0 if msg.decide else min(requested, limit - num_prompt)
    bound = num_prompt + max_tokens  # KV bound, never above max_context
    if -(-bound // block_size) > num_blocks:
        return context_error(
            msg,
            f"The request needs {bound} tokens of KV cache ({num_prompt} prompt + {max_tokens} to generate), "
            f"more than the pool holds ({num_blocks * block_size} tokens); lower max_tokens or the prompt.",
        )
    if not msg.decide and lanes_busy >= cfg.decode_lanes:
        return RequestFailed(
            request_id=msg.request_id,
            message=f"All {cfg.decode_lanes} decode lanes are busy; retry shortly.",
            code="engine_full",
            status=503,
            error_type="server_error",
            retry_after=retry_after(lane_holders, round_seconds, cfg.retry_after_floor),
        )
    sampling = SamplingParams.from_dict(msg.sampling or {})
    seed = sampling.seed if sampling.seed is not None else seed_rng.getrandbits(63)
    return Sequence(
        seq_id=seq_id,
        request_id=msg.request_id,
        reply_channel=msg.reply_channel,
        prompt_token_ids=list(msg.prompt_token_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        stop_token_ids=frozenset(msg.stop_token_ids or ()),
        request_class=msg.request_class or "interactive",
        num_logprobs=msg.num_logprobs,
        want_logprobs=msg.want_logprobs or msg.num_logprobs > 0,
        is_decide=msg.decide,
        shared_prefix_len=min(max(msg.shared_prefix_len, 0), num_prompt),
        prompt_logprobs=msg.prompt_logprobs,
        decide_token_ids=list(msg.decide_token_ids) if msg.decide_token_ids is not None else None,
        arrival_time=now,
    )
