"""What a speculative round's drafts are worth against what their rows cost (``spec.cost_aware``).

A verify row is cheap on a round bound by streaming the weights (a GPU at a few lanes) and not on
one bound by arithmetic (the CPU backends, a GPU's wide rounds: docs/SPECULATION.md measured eight
lanes with four drafts each at 2.26x the plain round). AdaptiveK sizes each lane's drafts from its
own acceptance alone, so with many lanes the drafts can cost more time than the tokens they add.

``RoundCost`` learns the round's seconds by its rows from the rounds the engine runs (a moving
average a row count; between row counts seen, a straight line), and ``plan_drafts`` keeps, of the
drafts the lanes asked for, the count that makes the most expected tokens a second: draft j of a
lane whose acceptance rate is r adds r^j expected tokens (its run of kept drafts is geometric), so
the best D drafts are the D largest of those gains, and D is chosen over 0..all by
(lanes + their gains) / cost(base rows + D). Where a needed row count's cost is not known yet the
drafts are kept as asked (that round then teaches it), and every ``probe_every`` rounds that
speculate one round runs without drafts when its plain cost is not known, so the base stays known.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

MAX_RATE = 0.95  # as AdaptiveK: a lane's gains never reach 1


class RoundCost:
    """Seconds a decode round takes by its row count, learned from the rounds run."""

    def __init__(self, alpha: float = 0.2, probe_every: int = 32) -> None:
        self.alpha, self.probe_every = alpha, probe_every
        self._seconds: dict[int, float] = {}
        self._seen: list[int] = []  # the row counts of _seconds, sorted
        self._since_probe = 0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        old = self._seconds.get(rows)
        if old is None:
            insort(self._seen, rows)
        self._seconds[rows] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def estimate(self, rows: int) -> float | None:
        """The round's seconds at ``rows``: as seen, else between the nearest row counts seen on
        either side, else None (none seen at or above it, or none below it)."""
        if rows in self._seconds:
            return self._seconds[rows]
        seen = self._seen
        i = bisect_left(seen, rows)
        if i == 0 or i == len(seen):
            return None
        lo, hi = seen[i - 1], seen[i]
        a, b = self._seconds[lo], self._seconds[hi]
        return a + (b - a) * (rows - lo) / (hi - lo)

    def probe(self, base_rows: int) -> bool:
        """Whether this speculating round should run without drafts, to learn its plain cost (its row
        count not seen yet, at most once every ``probe_every`` such rounds)."""
        self._since_probe += 1
        if self.estimate(base_rows) is not None or self._since_probe < self.probe_every:
            return False
        self._since_probe = 0
        return True


def plan_drafts(rates: Sequence[float], desired: Sequence[int], base_rows: int, cost: RoundCost) -> list[int]:
    """Drafts to keep per lane (a prefix of each lane's ``desired``) for the most expected tokens a
    second; ``rates``: the lanes' acceptance rates, ``base_rows``: the round's rows without drafts.
    The drafts as asked when a cost it needs is not known."""
    gains = sorted(
        ((min(max(r, 0.0), MAX_RATE) ** j, i) for i, (r, d) in enumerate(zip(rates, desired)) for j in range(1, d + 1)),
        key=lambda gi: -gi[0],
    )
    t = cost.estimate(base_rows)
    if t is None:
        return list(desired)
    tokens = float(len(rates))
    best, best_d = tokens / t, 0
    for d, (g, _) in enumerate(gains, 1):
        tokens += g
        t = cost.estimate(base_rows + d)
        if t is None:
            return list(desired)
        if tokens / t >= best:  # ties keep the draft (a free one still teaches its lane's rate)
            best, best_d = tokens / t, d
    keep = [0] * len(rates)
    for _, i in gains[:best_d]:
        keep[i] += 1
    return keep
