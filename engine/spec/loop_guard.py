"""The loop guard: notices reasoning that repeats itself back to back.

Greedy decoding of a small model falls into loops readily, and a reasoning
channel with no end costs a client its whole budget. The guard watches a
request's committed reasoning tokens; it fires when some span of at least
``min_span`` (at most ``max_span``) tokens has just occurred ``count`` times in
a row (a shorter period counts as its first multiple of at least
``min_span``: a one-token run fires once ``count * min_span`` tokens long). The
engine then takes the loop back between rounds: the sequence is
rewound to the end of the span's first occurrence (``rewind_to``), the
model's end-of-thinking text is forced, and generation continues into the
answer (engine/scheduler.py; docs/API.md documents what the client sees).

Incremental: for every period L it keeps how many tokens in a row have equalled
the token L before them; one vectorised comparison per committed token. A span
of length L repeated ``count`` times is ``(count - 1) * L`` such tokens in a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LoopGuard:
    min_span: int = 8
    max_span: int = 256
    count: int = 3
    tokens: list[int] = field(default_factory=list)
    _runs: np.ndarray = field(default=None, repr=False)  # [max_span + 1]: run length per period

    def __post_init__(self) -> None:
        if not 1 <= self.min_span <= self.max_span or self.count < 2:
            raise ValueError(f"need 1 <= min_span <= max_span and count >= 2 ({self.min_span}, {self.max_span}, "
                             f"{self.count})")  # fmt: skip
        self._runs = np.zeros(self.max_span + 1, dtype=np.int64)
        self._periods = np.arange(self.max_span + 1)

    def push(self, token: int) -> int | None:
        """Add one committed reasoning token; the span length if a loop just completed, else None."""
        n = len(self.tokens)
        self.tokens.append(int(token))
        if n == 0:
            return None
        reach = min(n, self.max_span)
        back = np.asarray(self.tokens[n - reach : n][::-1])  # back[L - 1]: the token L before this one
        eq = np.zeros(self.max_span + 1, dtype=bool)
        eq[1 : reach + 1] = back == token
        self._runs = np.where(eq, self._runs + 1, 0)
        hit = np.flatnonzero((self._runs >= (self.count - 1) * self._periods) & (self._periods >= self.min_span))
        return int(hit[0]) if hit.size else None

    def rewind_to(self, span: int) -> int:
        """How many of the watched tokens to keep when a loop of ``span`` fired: up to the end
        of its first occurrence."""
        return len(self.tokens) - (self.count - 1) * span

    def truncate(self, keep: int) -> None:
        """Forget every token from ``keep`` on (after a take-back) and start counting afresh."""
        del self.tokens[keep:]
        self._runs[:] = 0
