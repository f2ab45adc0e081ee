"""Drafters: what proposes a lane's next tokens before the round that checks them.

One interface for every kind (:class:`Drafter`): a drafter keeps per-sequence
state, hears every committed token (``commit``) and proposes up to ``k``
tokens (``propose``). Two need no model:

* :class:`PromptLookup`: n-gram matches of the sequence's latest tokens
  against its own prompt and output. The index maps each n-gram to where its
  continuation starts and is updated per committed token (never rebuilt); the
  longest n-gram that matches wins, at its most recent earlier occurrence.
* :class:`PredictionDrafter`: OpenAI Predicted Outputs. It follows the output
  through the request's ``prediction`` tokens while they agree and proposes
  what comes next there; after a divergence it re-finds its place by n-gram.

A draft model (``spec.draft_model``) and learned heads (EAGLE-3, MTP) fit the
same interface but need the engine's help: a draft model runs its own batched
rounds over its own KV pool, and a learned head reads the target's hidden
states of the last round (docs/SPECULATION.md says what each needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    """Per-sequence proposer. ``name`` labels its metrics (``ignis_spec_*{drafter=...}``)."""

    name: str

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence's newly committed tokens, in order (the prompt's first)."""

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens to follow the committed ones (fewer, or none, where it has no guess)."""


class NgramIndex:
    """n-gram -> start of its continuation (most recent occurrence), for n in ``min_n..max_n``.

    ``extend`` adds each token's n-grams as it arrives: when token ``i`` is appended,
    the n-grams ending just before it get continuation ``i``. The n-gram ending at the
    last token is only added with the next token, so a lookup never finds itself.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            i = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._index[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(int(t))

    def continuation(self, suffix: Sequence[int]) -> int | None:
        """Where the longest indexed n-gram ending ``suffix`` continues (None: no match)."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            start = self._index.get(tuple(suffix[len(suffix) - n :]))
            if start is not None:
                return start
        return None


class PromptLookup:
    """Proposes what followed the latest earlier occurrence of the sequence's last n tokens."""

    name = "prompt_lookup"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.index = NgramIndex(min_n, max_n)

    def commit(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def propose(self, k: int) -> list[int]:
        toks = self.index.tokens
        if k <= 0 or not toks:
            return []
        # The n-gram ending at the last token is not indexed yet, so any match is earlier.
        start = self.index.continuation(toks[-self.index.max_n :])
        if start is None:
            return []
        return toks[start : min(start + k, len(toks))]


class PredictionDrafter:
    """Predicted Outputs: walk the prediction alongside the output, propose what it says next.

    ``cursor`` is the prediction index the next output token is expected to match
    (None: lost). A committed token equal to ``prediction[cursor]`` advances it; any
    other loses it, and the output's last n tokens are then looked up in the
    prediction (its own n-gram index) to find the place again. While lost (or past
    its end) it proposes what ``fallback`` does (prompt lookup over the sequence),
    and ``source`` says which of the two the last proposal came from.
    """

    name = "prediction"

    def __init__(self, prediction: Sequence[int], prompt_len: int, min_n: int = 2, max_n: int = 6,
                 fallback: PromptLookup | None = None) -> None:  # fmt: skip
        self.fallback = fallback
        self.source = self.name
        self.prediction = [int(t) for t in prediction]
        self.index = NgramIndex(min_n, max_n)
        self.index.extend(self.prediction)
        self.cursor: int | None = 0
        self._recent: list[int] = []
        self._prompt_left = prompt_len  # the first tokens committed are the prompt's: not followed

    def commit(self, tokens: Sequence[int]) -> None:
        if self.fallback is not None:
            self.fallback.commit(tokens)
        skip = min(self._prompt_left, len(tokens))
        self._prompt_left -= skip
        for t in tokens[skip:]:
            t = int(t)
            self._recent = (self._recent + [t])[-self.index.max_n :]
            if self.cursor is not None and self.cursor < len(self.prediction) and self.prediction[self.cursor] == t:
                self.cursor += 1
                continue
            # Lost: the longest of the output's last n-grams found in the prediction says where.
            self.cursor = self.index.continuation(self._recent)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        if self.cursor is not None and self.cursor < len(self.prediction):
            self.source = self.name
            return self.prediction[self.cursor : self.cursor + k]
        if self.fallback is None:
            return []
        self.source = self.fallback.name
        return self.fallback.propose(k)
