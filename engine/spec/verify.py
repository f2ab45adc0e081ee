"""Acceptance: which of a lane's drafts a verify round keeps.

A lane that proposed drafts ``d_1..d_k`` after its last committed token runs
``k + 1`` rows; row ``j`` (0-based) predicts the token after ``d_j`` (``d_0``
being the committed one). Two rules:

* :func:`accept_sampled` (single-token proposals: prompt lookup, Predicted
  Outputs, a draft model's greedy tokens): every row is sampled by the
  ordinary sampler at its own position, with its drafts counted as output for
  the penalties; drafts are kept while they equal what their row sampled, and
  the first row that disagrees contributes its own sample. The committed
  tokens are exactly the ones the lane would have produced without
  speculation, since each kept row saw the same context and drew the same
  ``(seed, position)`` uniform. For the standard rule with a point-mass
  proposal this is one valid coupling: the draft is accepted with probability
  ``p(d)`` and a rejection yields ``p`` restricted to other tokens.
* :func:`accept_with_distribution` (a proposal drawn from a distribution
  ``q``, a sampling draft model): Leviathan et al.'s rule, accept ``d`` when
  ``u < p(d) / q(d)``, else draw from ``max(p - q, 0)`` renormalised; the
  emitted tokens are distributed as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine import sampler
from engine.backend import SampleRequest


def accept_sampled(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """Tokens to commit: ``drafts`` while each equals the row before it sampled, then that row's sample.

    ``sampled[j]`` is row j's token (``len(drafts) + 1`` rows). Always at least one token.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled rows, got {len(sampled)}")
    out: list[int] = []
    for d, s in zip(drafts, sampled):
        out.append(int(s))
        if int(s) != int(d):
            return out
    out.append(int(sampled[-1]))
    return out


def row_requests(req: SampleRequest, drafts: Sequence[int]) -> list[SampleRequest]:
    """One SampleRequest per verify row: row j counts drafts ``d_1..d_j`` as output (penalties)."""
    from dataclasses import replace

    rows = [req]
    out = list(req.output_token_ids)
    for d in drafts:
        out = out + [int(d)]
        rows.append(replace(req, output_token_ids=out))
    return rows


def accept_with_distribution(
    p: np.ndarray, q: np.ndarray, drafts: Sequence[int], seed: int, position: int
) -> list[int]:
    """The standard speculative-sampling rule over probability rows.

    ``p`` [k + 1, vocab]: the target's distributions (after the sampler's processing)
    at the verify rows; ``q`` [k, vocab]: the proposal's for each draft. Uniforms come
    from Philox keyed by the request's seed and each row's position (``position`` is
    row 0's), on a stream apart from the ordinary draw's.
    """
    k = len(drafts)
    out: list[int] = []
    for j in range(k):
        d = int(drafts[j])
        u = _uniform(seed, position + j, 1)
        if q[j, d] > 0 and u * q[j, d] < p[j, d]:
            out.append(d)
            continue
        residual = np.maximum(p[j] - q[j], 0.0)
        total = residual.sum()
        out.append(_draw(residual / total if total > 0 else p[j], _uniform(seed, position + j, 2)))
        return out
    out.append(_draw(p[k], _uniform(seed, position + k, 3)))
    return out


def _draw(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs, dtype=np.float64)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(j, len(probs) - 1)


def _uniform(seed: int, position: int, stream: int) -> float:
    # The ordinary draw uses (seed, position); acceptance tests use further streams of the same key.
    return sampler.uniform(seed, position, stream)
