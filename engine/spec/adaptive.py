"""How many drafts a lane proposes: k adapts to the lane's acceptance history.

A verify row costs little in a weight-bound round, but not nothing, and a
draft the model rejects is wasted work (and, on a lane that shares its round,
others' time). Each lane keeps an exponentially weighted acceptance rate; its
next k is the largest that the rate says will pay, between 0 and ``max_k``.
A lane whose drafts keep failing drops to k = 0 (speculation off for it) and
probes again every ``probe_every`` rounds with one draft, so a lane whose text
turns repetitive (a copied block) picks speculation back up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveK:
    max_k: int = 8
    alpha: float = 0.3  # weight of the latest round in the rate
    off_below: float = 0.2  # rate under which the lane stops speculating
    probe_every: int = 16  # rounds between one-draft probes while off
    rate: float = 0.6  # prior: a fresh lane starts at a moderate k
    _idle: int = 0

    def next_k(self, available: int) -> int:
        """Drafts to ask for this round, given that the drafter has ``available`` to offer."""
        if available <= 0 or self.max_k <= 0:
            return 0
        if self.rate < self.off_below:
            self._idle += 1
            if self._idle < self.probe_every:
                return 0
            self._idle = 0
            return 1
        # Expected accepted run of a geometric acceptance: r / (1 - r); ask for about twice that.
        r = min(self.rate, 0.95)
        k = max(1, round(2 * r / (1 - r)))
        return min(k, self.max_k, available)

    def update(self, proposed: int, accepted: int) -> None:
        """After a verify round: ``accepted`` of ``proposed`` drafts kept."""
        if proposed <= 0:
            return
        self.rate = (1 - self.alpha) * self.rate + self.alpha * (accepted / proposed)
