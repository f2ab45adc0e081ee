"""The top-k set and the top-p nucleus of a row without sorting or selecting over all of it (engine/sampler.py's cuts).

Both return exactly the entries the dense definitions keep (argpartition's top-k set; the
smallest prefix of the stable descending order whose float64 mass reaches top_p), so a
row's token never depends on how they were found; tests/engine/test_sampler.py checks them
against the dense implementation (tests/engine/sampler_before.py) bit for bit.
"""

from __future__ import annotations

import numpy as np

_TOP_K_REACH = (4.0, 8.0, 16.0, 32.0)  # logits below the best searched for the top-k set, widening


def top_k_set(x: np.ndarray, k: int) -> np.ndarray | None:
    """Ascending indices of the ``k`` largest entries when the k-th is strictly above the
    (k+1)-th (the set is then unique: argpartition's too) and all are finite; else None.

    The k+1 largest are looked for among the entries within a few logits of the best,
    one comparison pass, instead of a selection over the whole row."""
    best = x.max()
    if not np.isfinite(best):
        return None
    for reach in _TOP_K_REACH:
        cand = np.flatnonzero(x >= best - np.float32(reach))
        if len(cand) > k:
            break
    else:
        return None
    vals = x[cand]
    part = np.partition(vals, [len(vals) - k - 1, len(vals) - k])
    kth, after = part[len(vals) - k], part[len(vals) - k - 1]
    if not kth > after:
        return None
    return cand[vals >= kth]


_TOP_P_BINS_PER_LOGIT = 16  # the histogram of the dense fallback (nucleus_by_bins): bins per logit
_TOP_P_BINS = 512  # 32 logit units; everything further below the best shares the last bin


def nucleus(xl: np.ndarray, top_p: float) -> np.ndarray:
    """Ascending positions in ``xl`` (the survivors, all finite) of the smallest prefix of
    their stable descending order whose mass reaches ``top_p`` (always >= 1 token).

    Mass is float64: e = exp(x - best), probs = e / e.sum(), and entry j is kept while
    ``cumsum(probs) - probs`` (the mass before it, summed in that order) is below top_p.
    Only a prefix can survive, so only candidates {x >= t} (a prefix of the stable order,
    ties included) are sorted: t a few logits below the best, found by float32 masses
    (:func:`candidates`); a float64 mass short of top_p takes every survivor. A stable
    argsort of a 50k-152k vocabulary costs milliseconds per row; this costs a few passes
    over it and one sort of the candidates' keys (:func:`descending`).

    Two prefixes reaching top_p keep the same entries unless rounding makes a mass before
    an entry fall below top_p past the point where the cumulative sum reached it (within
    one ulp of top_p); then the histogram cut this sampler always used decides
    (:func:`nucleus_by_bins`), so the kept set never depends on the candidates.
    """
    n = xl.shape[0]
    best = xl.max()
    e = np.subtract(xl, float(best), dtype=np.float64)  # xl's float64 values less best's: exact, then rounded
    e = np.exp(e, out=e)
    total = e.sum()
    cand = candidates(xl, best, e, top_p * total)
    while True:
        if cand is None:
            cand = np.arange(n)
        idx = descending(xl, cand)
        probs = e[idx] / total
        cum = np.cumsum(probs)
        if len(idx) == n or cum[-1] >= top_p + 1e-12:
            break
        cand = None  # short, or too close to call where a longer prefix could differ: every survivor
    keep = cum - probs < top_p
    if keep[1:].any() and cum[:-1][keep[1:]].max() >= top_p:  # a rounding flip past the top_p point
        return np.sort(nucleus_by_bins(xl, top_p))
    return np.sort(idx[keep])


def candidates(xl: np.ndarray, best: np.float32, e: np.ndarray, goal: float) -> np.ndarray | None:
    """Ascending indices {x >= best - reach} whose mass looks like exceeding ``goal`` (the caller checks
    its own float64 sum); None when 32 logits below the best hold too little (every survivor).

    The reach is 8 logits halved three times within those candidates (passes over them, not the row)
    when they hold the mass (a peaked row); else 16 or 32 logits halved twice on float32 masses over
    the row (a flat one: compacting its many candidates at each step would cost more). Masses are dot
    products: a boolean mask's compaction costs several times more."""
    goal = goal * (1 + 1e-9)  # a hair more than asked: the caller's sum is another order's
    cand = np.flatnonzero(xl >= best - np.float32(8.0))
    ec = e[cand]
    if ec.sum() > goal:
        xc, lo, hi = xl[cand], 0.0, 8.0
        for _ in range(3):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if float(np.dot(ec, xc >= best - np.float32(mid))) > goal else (mid, hi)
        return cand[np.flatnonzero(xc >= best - np.float32(hi))]
    e32, goal32 = e.astype(np.float32), goal * (1 + 1e-4)  # float32 sums: a little more again
    mass = lambda r: float(np.dot(e32, xl >= best - np.float32(r)))  # noqa: E731
    lo = 8.0
    for hi in (16.0, 32.0):
        if mass(hi) > goal32:
            break
        lo = hi
    else:
        return None
    for _ in range(2):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mass(mid) > goal32 else (mid, hi)
    return np.flatnonzero(xl >= best - np.float32(hi))


def descending(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``idx`` (ascending indices) in the stable descending order of ``x[idx]`` (finite): one sort of
    64-bit keys (an order-preserving map of -x, then the index), the same permutation as
    ``idx[argsort(-x[idx], kind="stable")]`` at a fraction of a merge sort's cost."""
    v = (np.float32(0.0) - x[idx]).view(np.uint32)  # 0 - x: -0.0 and +0.0 both +0.0, tied as < ties them
    key = np.where(v >> np.uint32(31), ~v, v | np.uint32(0x80000000)).astype(np.uint64) << np.uint64(32)
    key |= idx.astype(np.uint64)
    key.sort()
    return (key & np.uint64(0xFFFFFFFF)).astype(np.intp)


def nucleus_by_bins(xl: np.ndarray, top_p: float) -> np.ndarray:
    """:func:`nucleus`'s positions (in no order) with its candidates cut by one histogram of the
    survivors' mass by distance below the best logit (bins of 1/16): the first bins whose mass
    reaches top_p, widened a bin while rounding leaves their mass short."""
    best = xl.max()
    e = np.exp(xl.astype(np.float64) - float(best))
    total = e.sum()
    bins = np.minimum((best - xl) * np.float32(_TOP_P_BINS_PER_LOGIT), np.float32(_TOP_P_BINS - 1)).astype(np.intp)
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
    return idx[cum - probs < top_p]
