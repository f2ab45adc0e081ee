"""Engine logprobs (``TokenEvent.logprobs``: ``{token_id, logprob, top: [[id, lp], ...]}`` per token)
in the API's shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the legacy
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

A token's text is its own bytes (a token may hold part of a UTF-8 character;
``bytes`` carries them exactly, ``token`` shows them decoded with replacement).
"""

from __future__ import annotations

import math

MAX_TOP_LOGPROBS = 20
_FLOOR = -9999.0  # -inf is not JSON


def token_bytes(bundle, token_id: int) -> bytes:
    from engine.constraint import ll_tokenizer_for  # the engine's own, shared when embedded

    return ll_tokenizer_for(bundle).decode_bytes([int(token_id)])


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def _entry(bundle, token_id: int, logprob: float) -> dict:
    raw = token_bytes(bundle, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _lp(logprob), "bytes": list(raw)}


def chat_logprobs(bundle, items: list[dict], num_top: int) -> list[dict]:
    """The ``content`` list for these engine logprob items."""
    out = []
    for it in items:
        entry = _entry(bundle, it["token_id"], it["logprob"])
        entry["top_logprobs"] = [_entry(bundle, t, lp) for t, lp in it.get("top", [])[:num_top]]
        out.append(entry)
    return out


class LegacyLogprobs:
    """Accumulates the legacy ``logprobs`` object; ``text_offset`` counts characters of the choice's text."""

    def __init__(self, bundle, num_top: int, offset: int = 0):
        self.bundle = bundle
        self.num_top = num_top
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: list | None) -> dict:
        """Record one token; returns the chunk-sized object for just this token (for streaming)."""
        text = token_bytes(self.bundle, token_id).decode("utf-8", errors="replace")
        lp = None if logprob is None else _lp(logprob)
        tops = None
        if top is not None:
            tops = {}
            for t, v in top[: self.num_top]:
                tops.setdefault(token_bytes(self.bundle, t).decode("utf-8", errors="replace"), _lp(v))
        self.tokens.append(text)
        self.token_logprobs.append(lp)
        self.top_logprobs.append(tops)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        return {
            "tokens": [text],
            "token_logprobs": [lp],
            "top_logprobs": [tops],
            "text_offset": [self.offset - len(text)],
        }

    def score(self, i: int, logprob: float, top: list) -> None:
        """Fill in entry ``i``, added with null logprobs (an echoed prompt token the engine scored later)."""
        self.token_logprobs[i] = _lp(logprob)
        tops: dict = {}
        for t, v in top[: self.num_top]:
            tops.setdefault(token_bytes(self.bundle, t).decode("utf-8", errors="replace"), _lp(v))
        self.top_logprobs[i] = tops

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
