"""Token sampling on the host: penalties, temperature, truncation, a seeded draw.

Each row is processed on its own, vectorized over the vocabulary, so a row's
token depends only on its own logits, parameters, token history, seed and
position -- never on which other rows shared the round. Randomness comes from
a counter-based generator (Philox) keyed by ``(seed, position)``.

Order per row (the usual HF/vLLM order):

1. repetition penalty over prompt + output tokens (HF: positive logits are
   divided by the penalty, negative ones multiplied);
2. presence and frequency penalties over output tokens (OpenAI semantics:
   ``logit -= frequency * count + presence * (count > 0)``); then ``logit_bias``
   added, the grammar's mask, and the suppressed tokens (stop ids before
   ``min_tokens``) masked unless that would leave no token;
3. greedy rows (``temperature`` below ``MIN_TEMPERATURE``, 0 included, or
   ``top_k == 1``) take the argmax here;
4. temperature, then top-k, top-p and min-p masks (masked logits = -inf);
5. an inverse-CDF draw with one uniform from Philox(seed, position).

Logprobs are the log-softmax of the distribution the token was drawn from
(after step 4; for greedy rows after step 2, at temperature 1). Top
alternatives only list tokens with a finite logprob.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine import truncation
from engine.backend import SampleRequest, TokenLogprob
from engine.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def sample_rows(
    logits: np.ndarray, requests: Sequence[SampleRequest], positions: Sequence[int]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Draw one token per row of ``logits`` [n, vocab]; return tokens and logprobs."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or len(requests) != logits.shape[0] or len(positions) != logits.shape[0]:
        raise ValueError(f"logits {logits.shape} vs {len(requests)} requests, {len(positions)} positions")
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    for row, req, pos in zip(logits, requests, positions):
        token, lp = sample_row(row, req, pos)
        tokens.append(token)
        logprobs.append(lp)
    return tokens, logprobs


def sample_row(row: np.ndarray, req: SampleRequest, position: int) -> tuple[int, TokenLogprob | None]:
    """One row of :func:`sample_rows`; ``row`` is never modified."""
    p = req.params
    x = np.array(row, dtype=np.float32, copy=True)
    apply_penalties(x, p, req.prompt_token_ids, req.output_token_ids)
    apply_logit_bias(x, p)
    if req.constraint is not None:  # a grammar: disallowed tokens can be neither drawn nor listed
        req.constraint.mask_logits(x)
    suppress(x, req.suppress_token_ids)
    if p.is_greedy:
        token = int(np.argmax(x))
    else:
        x = np.divide(x, np.float32(p.temperature), out=x)  # x is this row's own copy
        live, vals = _truncate(x, p)
        if live is None:
            token = draw(x, req.seed, position)
        else:
            token = int(live[_draw_index(vals, req.seed, position)])
            if req.want_logprobs:
                x = _dense(x, live, vals)
    if not req.want_logprobs:
        return token, None
    return token, token_logprob(x, token, req.num_logprobs)


def apply_penalties(x: np.ndarray, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
    """Repetition, presence and frequency penalties, in place on ``x`` [vocab]."""
    vocab = x.shape[0]
    if p.repetition_penalty != 1.0 and (len(prompt_ids) or len(output_ids)):
        seen = np.unique(np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)]))
        seen = seen[(seen >= 0) & (seen < vocab)]
        v = x[seen]
        x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(output_ids):
        ids, counts = np.unique(np.asarray(output_ids, np.int64), return_counts=True)
        keep = (ids >= 0) & (ids < vocab)
        ids, counts = ids[keep], counts[keep]
        x[ids] -= np.float32(p.frequency_penalty) * counts.astype(np.float32) + np.float32(p.presence_penalty)


def has_edits(req: SampleRequest) -> bool:
    """Whether a logit bias or a suppression changes the row (the CUDA backend then draws it on the host)."""
    return bool(req.params.logit_bias or req.suppress_token_ids)


def apply_logit_bias(x: np.ndarray, p: SamplingParams) -> None:
    """``logit_bias`` added in place on ``x`` [vocab]; ids outside the vocabulary are skipped (the API
    refuses them first)."""
    vocab = x.shape[0]
    for token, bias in p.logit_bias:
        if 0 <= token < vocab:
            x[token] += np.float32(bias)


def suppress(x: np.ndarray, token_ids: Sequence[int]) -> None:
    """Mask ``token_ids`` (-inf) in place, after any grammar's mask, unless that would leave no token
    (a grammar that admits only EOS at its end: the stop comes, ``min_tokens`` or not)."""
    vocab = x.shape[0]
    ids = [t for t in token_ids if 0 <= t < vocab]
    if ids:
        kept = x[ids].copy()
        x[ids] = -np.inf
        if not np.isfinite(x).any():
            x[ids] = kept


def process_logits(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, then top-k / top-p / min-p masks (masked entries become -inf)."""
    x = x / np.float32(p.temperature)
    live, vals = _truncate(x, p)
    return x if live is None else _dense(x, live, vals)


def _truncate(x: np.ndarray, p: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """The masks of :func:`process_logits` on the temperature-scaled ``x`` (modified in place).

    Returns ``(None, x)`` when ``x`` itself is the masked row, or ``(live, vals)``: the
    ascending indices of the only entries left above -inf and their values (all finite),
    the rest of the row being -inf -- what a small nucleus or top-k set is drawn from
    without another pass over the vocabulary. Either way the same entries with the same
    values as the one dense implementation (tests/engine/sampler_before.py keeps it)."""
    vocab = x.shape[0]
    live = vals = None
    if 0 < p.top_k < vocab:
        live = truncation.top_k_set(x, p.top_k)
        if live is None:  # a tie at the boundary, or non-finite entries: argpartition decides, as ever
            # Keep exactly top_k entries (ties at the boundary broken by argpartition).
            drop = np.argpartition(-x, p.top_k)[p.top_k :]
            x[drop] = -np.inf
        else:
            vals = x[live]
    if p.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        if live is None:
            x[x < x.max() + np.float32(np.log(p.min_p))] = -np.inf
        else:
            keep = ~(vals < vals.max() + np.float32(np.log(p.min_p)))
            live, vals = live[keep], vals[keep]
    if p.top_p < 1.0:
        if live is None:
            finite = np.isfinite(x)
            if finite.all():
                live = truncation.nucleus(x, p.top_p)
                return live, x[live]
            live = np.flatnonzero(finite)
            if np.count_nonzero(x == -np.inf) + len(live) < vocab:  # NaN or +inf entries: the dense mask
                _top_p_mask(x, p.top_p)
                return None, x
            vals = x[live]
        kept = truncation.nucleus(vals, p.top_p)
        live, vals = live[kept], vals[kept]
    return (None, x) if live is None else (live, vals)


def _dense(x: np.ndarray, live: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """The row of :func:`_truncate`'s ``(live, vals)``: -inf everywhere else."""
    out = np.full_like(x, -np.inf)
    out[live] = vals
    return out


def _top_p_mask(x: np.ndarray, top_p: float) -> None:
    """Keep the smallest prefix of the (stable) descending order whose mass reaches
    ``top_p`` (always >= 1 token) over the finite entries, in place; NaN and +inf entries
    are left as they are (rows :func:`_truncate` does not take apart)."""
    live = np.flatnonzero(np.isfinite(x))
    keep = np.zeros(len(live), dtype=bool)
    keep[truncation.nucleus(x[live], top_p)] = True
    x[live[~keep]] = -np.inf


def draw(x: np.ndarray, seed: int, position: int) -> int:
    """Inverse-CDF draw from softmax(x) with one uniform keyed by (seed, position).

    Only the finite entries take part: masked ones add exact zeros to the CDF, so
    leaving them out changes no token, and a top-p row then costs its nucleus, not
    the vocabulary.
    """
    above = x > -np.inf
    if above.all():
        return _draw_index(x, seed, position)
    live = np.flatnonzero(above)
    return int(live[_draw_index(x[live], seed, position)])


_DRAW_BLOCK = 256  # entries a block of the draw's two-level search


def _draw_index(vals: np.ndarray, seed: int, position: int) -> int:
    """The position in ``vals`` (the row's entries above -inf, in index order) of the draw: the
    first j with cdf[j] > u * cdf[-1], cdf the float64 cumulative sum of softmax(vals)."""
    probs = _softmax64(vals)
    u = _uniform(seed, position)
    if probs.shape[0] > 4 * _DRAW_BLOCK:
        j = _search_blocks(probs, u)
        if j is not None:
            return j
    cdf = np.cumsum(probs)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if j >= cdf.shape[0] or probs[j] == 0.0:
        # u rounded up to the total mass: take the last token that has any.
        j = int(np.flatnonzero(probs)[-1])
    return j


def _search_blocks(probs: np.ndarray, u: float) -> int | None:
    """:func:`_draw_index`'s j from block sums and one block's cumulative sum, or None when that
    cannot tell. Either way of summing is within ``n`` roundings of 2^-53 of the exact partial
    sums (all <= 1), so a j whose two partial sums lie further than twice that from u times the
    total is the full cumulative sum's j: one pass over the row instead of a sequential sum."""
    n = probs.shape[0]
    margin = 4 * n * 2.0**-53
    blocks = np.cumsum(np.add.reduceat(probs, np.arange(0, n, _DRAW_BLOCK)))
    target = u * blocks[-1]
    b = int(np.searchsorted(blocks, target, side="right"))
    if b >= blocks.shape[0]:
        return None
    lo = blocks[b - 1] if b else 0.0
    local = lo + np.cumsum(probs[b * _DRAW_BLOCK : (b + 1) * _DRAW_BLOCK])
    k = int(np.searchsorted(local, target, side="right"))
    if k >= local.shape[0]:
        return None
    prev = local[k - 1] if k else lo
    if not ((b == 0 and k == 0) or prev < target - margin) or not local[k] > target + margin:
        return None
    return b * _DRAW_BLOCK + k


def token_logprob(x: np.ndarray, token: int, num_top: int) -> TokenLogprob:
    lp = log_softmax(x)
    top: list[tuple[int, float]] = []
    if num_top > 0:
        k = min(num_top, lp.shape[0])
        cand = np.argpartition(-lp, k - 1)[:k] if k < lp.shape[0] else np.arange(lp.shape[0])
        cand = cand[np.lexsort((cand, -lp[cand]))]
        top = [(int(i), float(lp[i])) for i in cand if np.isfinite(lp[i])]
    return TokenLogprob(token_id=int(token), logprob=float(lp[token]), top=top)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    m = x64.max()
    return x64 - (m + np.log(np.exp(x64 - m).sum()))


def _softmax64(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max())
    return e / e.sum()


_PHILOX_M = (0xD2E7470EE14C6C93, 0xCA5A826395121157)  # Philox4x64's multipliers
_PHILOX_W = (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)  # and its key's increments (Weyl)


def uniform(seed: int, position: int, stream: int = 0) -> float:
    """The uniform in [0, 1) keyed by ``(seed, position)``; ``stream`` > 0 gives further
    independent ones of the same key (Philox counter), as speculative acceptance needs.

    numpy's ``Generator(Philox(key=[seed, position], counter=stream)).random()``, bit for
    bit (tests/engine/test_sampler.py checks), computed here on Python integers: its first
    64-bit word of Philox4x64-10 at counter + 1, as a double of its top 53 bits. A
    Generator's construction cost more than the row's draw it keyed."""
    k0, k1 = int(seed) & _MASK64, int(position) & _MASK64
    c = (int(stream) + 1) % (1 << 256)
    c0, c1, c2, c3 = c & _MASK64, (c >> 64) & _MASK64, (c >> 128) & _MASK64, c >> 192
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK64, (k1 + _PHILOX_W[1]) & _MASK64
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & _MASK64
    return (c0 >> 11) * 2.0**-53


_uniform = uniform
