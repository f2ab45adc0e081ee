"""Sampling: on the device for every row (penalties, then greedy or a seeded draw), on the
host for grammar-constrained rows, and logprobs from the read-back logits.

The device draw uses the same Philox (seed, position) uniform as engine/sampler.py, so a
request draws the same uniform on both backends (sample.cu).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine import sampler
from engine.backend import SampleRequest, TokenLogprob

_MASK64 = (1 << 64) - 1


def stage_row(st, row: int, req: SampleRequest, position: int, vocab: int, pen_stride: int) -> bool:
    """Write row ``row``'s sampling inputs into staging ``st``; returns whether it has penalties."""
    p = req.params
    # A greedy row goes to the device as T = 0: the host's is_greedy decides, never float32 rounding.
    st.view["params"][row * 8 : row * 8 + 8] = (
        0.0 if p.is_greedy else p.temperature, p.top_p, float(p.top_k), p.min_p, p.presence_penalty, p.frequency_penalty,
        p.repetition_penalty, 0.0,
    )  # fmt: skip
    st.view["seeds"][row] = int(req.seed) & _MASK64
    st.view["sample_pos"][row] = position
    ids, counts = penalty_list(req, vocab)
    n = min(len(ids), pen_stride)
    st.view["pen_num"][row] = n
    if n:
        st.view["pen_tokens"][row * pen_stride : row * pen_stride + n] = ids[:n]
        st.view["pen_counts"][row * pen_stride : row * pen_stride + n] = counts[:n]
    return n > 0


def sample_on_device(kern, stream, logits: int, vocab: int, st, pen_stride: int, rows: int) -> None:
    """Penalties in place on ``logits`` [rows, vocab], then one token per row into ``st``'s ``out``."""
    p = st.ptr
    kern.penalties(stream, logits, vocab, p["params"], p["pen_tokens"], p["pen_counts"], p["pen_num"], pen_stride,
                   rows)  # fmt: skip
    kern.sample(stream, logits, vocab, p["params"], p["seeds"], p["sample_pos"], p["out"], rows)


def needs_logits(req: SampleRequest) -> bool:
    """Whether the row's logits must come back to the host (logprobs, a grammar, a bias or suppression)."""
    return req.want_logprobs or req.constraint is not None or sampler.has_edits(req)


def finish_row(row: np.ndarray, req: SampleRequest, token: int, position: int) -> tuple[int, TokenLogprob | None]:
    """The row's token and logprob: a constrained row is drawn here from its (penalised) logits
    ``row``; otherwise the device's ``token`` stands, with its logprob when asked."""
    if req.constraint is not None or sampler.has_edits(req):
        return host_sample(row, req, position)
    if req.want_logprobs:
        return token, logprob(row, req, token)
    return token, None


def host_sample(row: np.ndarray, req: SampleRequest, position: int) -> tuple[int, TokenLogprob | None]:
    """A grammar-constrained row is drawn on the host: its mask comes from the request's matcher,
    which lives in Python. ``row`` already carries the device's penalties, so the host sampler
    applies none of its own; the draw uses the same (seed, position) Philox as the device would."""
    p = req.params
    neutral = replace(req, params=replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0))
    return sampler.sample_row(row, neutral, position)


def logprob(row: np.ndarray, req: SampleRequest, token: int) -> TokenLogprob:
    x = np.array(row, dtype=np.float32)
    if not req.params.is_greedy:
        x = sampler.process_logits(x, req.params)
    return sampler.token_logprob(x, token, req.num_logprobs)


def penalty_list(req: SampleRequest, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids the penalties touch and their counts among generated tokens."""
    p = req.params
    rep = p.repetition_penalty != 1.0
    po = bool(p.presence_penalty or p.frequency_penalty)
    empty = np.zeros(0, np.int32)
    if not (rep or po):
        return empty, empty
    out_ids, out_counts = np.unique(np.asarray(req.output_token_ids, np.int64), return_counts=True)
    if rep:
        ids = np.unique(np.concatenate([np.asarray(req.prompt_token_ids, np.int64), out_ids]))
        counts = np.zeros(len(ids), np.int64)
        if po and len(out_ids):
            counts[np.searchsorted(ids, out_ids)] = out_counts
    else:
        ids, counts = out_ids, out_counts
    keep = (ids >= 0) & (ids < vocab)
    return ids[keep].astype(np.int32), counts[keep].astype(np.int32)
