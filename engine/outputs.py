"""What the scheduler hands the worker for one request: TokenEvent and RequestFinished.

Built from a Sequence's state, with no reply channel: the worker knows where
each request's replies go and serializes at the edge (``to_message()``).
"""

from __future__ import annotations

import numpy as np

from engine.backend import TokenLogprob
from engine.messages import RequestFinished, TokenEvent
from engine.sampler import log_softmax
from engine.sequence import Sequence

# What a step (or Scheduler.finish_requests) produces for one request.
EngineOutput = TokenEvent | RequestFinished


def logprob_item(lp: TokenLogprob) -> dict:
    """One position's logprobs as TokenEvent.logprobs / prompt_logprobs carry them."""
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}


def take_prompt_logprobs(seq: Sequence) -> list[dict] | None:
    """The prompt's scores, once: on the first message the request gets after its prefill."""
    if seq.prompt_logprobs is None or seq.prompt_lps_sent or seq.first_token_time is None:
        return None
    seq.prompt_lps_sent = True
    lps, seq.prompt_lps = seq.prompt_lps or [], None
    return lps


def token_event(seq: Sequence, token: int, lp: TokenLogprob | None, ttft: float | None) -> TokenEvent:
    """The event streaming ``token``, the newest of ``seq``'s output."""
    lps = [logprob_item(lp)] if seq.want_logprobs and lp is not None else None
    event = TokenEvent(seq.request_id, [int(token)], lps, seq.num_cached_tokens, ttft)
    event.prompt_logprobs = take_prompt_logprobs(seq)
    return event


def take_back_event(seq: Sequence, forced: list[int], taken_back: int, reason: str, ttft: float | None) -> TokenEvent:
    """The event of a take-back: ``taken_back`` streamed tokens are gone, ``forced`` end the thinking."""
    event = TokenEvent(seq.request_id, [int(t) for t in forced], None, seq.num_cached_tokens, ttft)
    if seq.want_logprobs:  # forced, not sampled: no alternatives, certain
        event.logprobs = [{"token_id": int(t), "logprob": 0.0, "top": []} for t in forced]
    event.taken_back, event.taken_back_reason = taken_back, reason
    event.prompt_logprobs = take_prompt_logprobs(seq)
    return event


def request_finished(seq: Sequence, logits: np.ndarray | None = None) -> RequestFinished:
    """The last message of a finished ``seq``. A decide request passes its last-position
    ``logits``: back come the log-softmax values of its ``decide_token_ids`` when it named
    some (None for an id outside the vocabulary), else the whole row."""
    done = RequestFinished(
        seq.request_id,
        seq.finish_reason or "stop",
        seq.num_prompt_tokens,
        seq.num_generated,
        seq.num_cached_tokens,
        None,
        take_prompt_logprobs(seq),
    )
    done.taken_back_tokens = seq.num_taken_back
    done.spec_drafted, done.spec_accepted = seq.num_spec_drafted, seq.num_spec_accepted
    if getattr(seq.drafter, "name", None) == "prediction":
        done.accepted_prediction_tokens = seq.num_accepted
        done.rejected_prediction_tokens = seq.num_drafted - seq.num_accepted
    if logits is not None and seq.decide_token_ids is not None:
        lp, vocab = log_softmax(logits), len(logits)
        done.decide_logprobs = [float(lp[t]) if 0 <= t < vocab else None for t in seq.decide_token_ids]
    elif logits is not None:
        done.logits = [float(x) for x in logits]
    return done
