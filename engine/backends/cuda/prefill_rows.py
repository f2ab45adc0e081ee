"""Which spans of a prefill group run as one pass of the CUDA forward, and where their rows sit.

A group (engine/prefill_group.py) is several whole prompts prefilled in one step. Its spans'
rows go through the weight products together (``Forward.prefill_rows``: one GEMM per matrix
over all of them, attention span by span) when each span gets there exactly the bits its
``prefill`` alone gets:

* more than ``narrow`` rows (the backend's ``prefill_gemv_rows``, ``cuda.round_rows``' cap, which
  ``Kernels.gemv_cap`` holds while prefill runs): alone, such a span's products
  run the GEMM, whose rows do not depend on the rows beside them (gemm_hopper.cu: one tile
  walks the whole K, no split), so they come out the same in a wider GEMM; a span the GEMV
  takes alone would get the GEMM's rounding in the group instead, so it prefills alone (fed as
  decode rows anyway at the default ``model.short_prefill``);
* a plain span: no images, raw logits (decide) or prompt scoring, whose extra rows and copies
  only ``prefill`` handles, and no penalties on its draw (the prefill staging holds one row of
  penalty lists);
* the rows fit the activations (``max_rows``) and the spans the sampling rows (``max_spans``).

The head then takes each sampled span's last row (``SpanRows.last``), in slices the GEMV takes,
as its ``prefill`` alone does with one row. Pure functions (tests/kernels/test_cuda_prefill_group.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.backend import PrefillSpan, SampleRequest


def prefill_fields(max_spans: int, bt_stride: int, max_context: int, pen_stride: int, *, mrope: bool) -> dict:
    """The prefill staging (``runtime.Staging``), in upload order: a sampling row and a block table
    for each of up to ``max_spans`` spans (a pass's; one span alone uses the first), a pass's span
    table (``span_table``: Kernels.prefill_attention_spans' rows), the rows' tokens, rope positions
    (three a row with multimodal rope) and KV slots, one penalty list."""
    G = max_spans
    return {
        "sample_pos": (np.int32, G), "seeds": (np.uint64, G), "params": (np.float32, 8 * G), "pen_num": (np.int32, G),
        "out": (np.int32, G), "block_table": (np.int32, G * bt_stride), "span_table": (np.int32, 4 * G),
        "tokens": (np.int32, max_context),
        "positions": (np.int32, (3 if mrope else 1) * max_context), "slots": (np.int32, max_context),
        "pen_tokens": (np.int32, pen_stride), "pen_counts": (np.int32, pen_stride),
    }  # fmt: skip


@dataclass(frozen=True)
class SpanRows:
    """One span of a pass: its index among the group's spans and where it sits in the staging."""

    index: int
    row0: int  # its first row among the pass's rows (tokens, positions, slots)
    rows: int
    table0: int  # its block table's first entry among the staged tables
    start: int  # the position of its first row

    @property
    def last(self) -> int:
        """The row that samples the span's first token."""
        return self.row0 + self.rows - 1


def has_penalties(req: SampleRequest | None) -> bool:
    """Whether the draw has a penalty list (sampling.penalty_list is empty whenever this is False)."""
    if req is None:
        return False
    p = req.params
    counts_outputs = bool(p.presence_penalty or p.frequency_penalty) and len(req.output_token_ids) > 0
    return p.repetition_penalty != 1.0 or counts_outputs


def joins(span: PrefillSpan, narrow: int, max_rows: int) -> bool:
    """Whether ``span`` may run in a pass with others (the module doc's conditions but the totals)."""
    return (
        narrow < len(span.token_ids) <= max_rows
        and not span.images
        and not span.want_logits
        and span.want_prompt_logprobs is None
        and not has_penalties(span.sample)
    )


def layout(spans: Sequence[PrefillSpan], *, narrow: int, max_rows: int, max_spans: int) -> list[SpanRows]:
    """The spans that run in one pass, in order, with their rows and tables laid out one after
    another; [] when fewer than two qualify (a single span prefills alone). A span that does not
    qualify, or no longer fits the rows or spans left, prefills alone; the next ones may still join."""
    out: list[SpanRows] = []
    row, table = 0, 0
    for i, span in enumerate(spans):
        n = len(span.token_ids)
        if len(out) == max_spans or not joins(span, narrow, max_rows) or row + n > max_rows:
            continue
        out.append(SpanRows(i, row, n, table, span.start_pos))
        row += n
        table += len(span.block_table)
    return out if len(out) > 1 else []


def head_slices(num: int, width: int) -> list[tuple[int, int]]:
    """(first, count) slices of ``num`` head rows, each at most ``width`` (the GEMV's rows)."""
    return [(r, min(width, num - r)) for r in range(0, num, width)]
