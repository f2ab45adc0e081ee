"""POST /v1/completions (and /v1/tokenize's prompt form): the body as a declared serializer."""

from __future__ import annotations

from typing import Any

from apps.api.schemas.chat import MAX_MESSAGE_CHARS, MAX_N, MAX_TOP_LOGPROBS, SamplingBody
from apps.api.schemas.fields import Bool, Integer, Str, Strict

TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


def _ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


class Prompt(Strict):
    """A string, strings, token ids, or token-id lists: returned as a list of prompts (each a str or ids)."""

    schema = {
        "anyOf": [
            {"type": "string", "maxLength": MAX_MESSAGE_CHARS},
            {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": {"type": "string"}},
            TOKEN_IDS,
            {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": TOKEN_IDS},
        ]
    }

    def to_internal_value(self, data: Any) -> list:
        prompts = None
        if isinstance(data, str):
            prompts = [data]
        elif _ids(data):
            prompts = [data]
        elif isinstance(data, list) and data and (all(isinstance(p, str) for p in data) or all(map(_ids, data))):
            prompts = data
        if prompts is None:
            self.bad(
                "'prompt' must be a string, an array of strings, an array of token ids, or an array of token-id "
                "arrays.",
                "invalid_type",
            )
        if len(prompts) > MAX_N:
            self.bad(f"At most {MAX_N} prompts per request.")
        if any(len(p) > MAX_MESSAGE_CHARS for p in prompts):
            self.bad(f"A prompt may hold at most {MAX_MESSAGE_CHARS} characters.")
        return prompts


class CompletionBody(SamplingBody):
    prompt = Prompt(required=True)
    max_tokens = Integer(0, 1 << 30, description="0 with echo: score the prompt, generate nothing")
    echo = Bool()
    logprobs = Integer(0, MAX_TOP_LOGPROBS, description="legacy: how many alternatives per token")
    best_of = Integer(1, MAX_N, description="must equal n")
    suffix = Str(description="accepted and ignored")
