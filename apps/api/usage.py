"""The usage block of every answer, in its two shapes, built here only.

Chat and text completions and /v1/decide count ``prompt_tokens`` /
``completion_tokens`` (``usage_block``); the Responses API and /v1/decisions
count ``input_tokens`` / ``output_tokens`` (``usage_object``).
"""

from __future__ import annotations


def usage_block(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    *,
    reasoning_tokens: int | None = 0,
    prediction: tuple[int, int] | None = None,
) -> dict:
    """``reasoning_tokens=None``: a route that decodes nothing (/v1/decide) has no completion details.
    ``prediction``: a request with Predicted Outputs, its (accepted, rejected) prediction tokens."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        if prediction is not None:
            details = usage["completion_tokens_details"]
            details["accepted_prediction_tokens"], details["rejected_prediction_tokens"] = prediction
    return usage


def usage_object(
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    reasoning_tokens: int = 0,
    *,
    cache_write_tokens: int = 0,
) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
