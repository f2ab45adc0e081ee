"""The oracle of tests/engine/test_sampler.py: engine/sampler.py as it was at 71641df (every pass
dense over the vocabulary), kept verbatim below this paragraph; the sampler must give the same
tokens and logprobs, bit for bit, for the same (logits, params, seed, position).

Token sampling on the host: penalties, temperature, truncation, a seeded draw.

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
        x = process_logits(x, p)
        token = draw(x, req.seed, position)
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
    vocab = x.shape[0]
    if 0 < p.top_k < vocab:
        # Keep exactly top_k entries (ties at the boundary broken by argpartition).
        drop = np.argpartition(-x, p.top_k)[p.top_k :]
        x[drop] = -np.inf
    if p.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        x[x < x.max() + np.float32(np.log(p.min_p))] = -np.inf
    if p.top_p < 1.0:
        _top_p_mask(x, p.top_p)
    return x


_TOP_P_BINS_PER_LOGIT = np.float32(16)  # histogram bins of the top-p cut per logit unit
_TOP_P_BINS = 512  # 32 logit units; everything further below the best shares the last bin


def _top_p_mask(x: np.ndarray, top_p: float) -> None:
    """Keep the smallest prefix of the (stable) descending order whose mass reaches
    ``top_p`` (always >= 1 token), over the survivors of top-k / min-p.

    Only a prefix can survive, so only the candidates above a cut are sorted. The
    cut comes from one histogram of the survivors' mass by distance below the best
    logit (bins of 1/16): the first bins whose mass reaches ``top_p``. A bin holds
    every entry tied with any of its entries, so the candidates are exactly a prefix
    of the full stable order, and their sorted cumulative sum is the full sort's; the
    cut widens a bin if rounding leaves their mass short. A full argsort of a
    50k-152k vocabulary costs milliseconds per row; this costs a few passes over it.
    """
    finite = np.isfinite(x)
    live = None if finite.all() else np.flatnonzero(finite)  # None: every entry (no earlier mask)
    xl = x if live is None else x[live]
    best = xl.max()
    e = np.exp(xl.astype(np.float64) - float(best))
    total = e.sum()
    bins = np.minimum((best - xl) * _TOP_P_BINS_PER_LOGIT, np.float32(_TOP_P_BINS - 1)).astype(np.intp)
    mass = np.cumsum(np.bincount(bins, weights=e, minlength=_TOP_P_BINS))
    last = int(np.searchsorted(mass, top_p * total))  # first bin whose cumulative mass reaches top_p
    while True:
        cand = np.flatnonzero(bins <= last) if last < _TOP_P_BINS - 1 else np.arange(len(xl))
        idx = cand[np.argsort(-xl[cand], kind="stable")]
        probs = e[idx] / total
        cum = np.cumsum(probs)
        if len(cand) == len(xl) or cum[-1] >= top_p:
            break
        last += 1
    kept = idx[cum - probs < top_p]
    if live is None:  # the nucleus is small: rewrite the row around it
        vals = x[kept]
        x.fill(-np.inf)
        x[kept] = vals
    else:
        keep = np.zeros(len(live), dtype=bool)
        keep[kept] = True
        x[live[~keep]] = -np.inf


def draw(x: np.ndarray, seed: int, position: int) -> int:
    """Inverse-CDF draw from softmax(x) with one uniform keyed by (seed, position).

    Only the finite entries take part: masked ones add exact zeros to the CDF, so
    leaving them out changes no token, and a top-p row then costs its nucleus, not
    the vocabulary.
    """
    live = np.flatnonzero(x > -np.inf)
    probs = _softmax64(x[live])
    cdf = np.cumsum(probs)
    u = _uniform(seed, position) * cdf[-1]
    j = int(np.searchsorted(cdf, u, side="right"))
    if j >= cdf.shape[0] or probs[j] == 0.0:
        # u rounded up to the total mass: take the last token that has any.
        j = int(np.flatnonzero(probs)[-1])
    return int(live[j])


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


def uniform(seed: int, position: int, stream: int = 0) -> float:
    """The uniform in [0, 1) keyed by ``(seed, position)``; ``stream`` > 0 gives further
    independent ones of the same key (Philox counter), as speculative acceptance needs."""
    key = np.array([int(seed) & _MASK64, int(position) & _MASK64], dtype=np.uint64)
    return float(np.random.Generator(np.random.Philox(key=key, counter=int(stream))).random())


_uniform = uniform
