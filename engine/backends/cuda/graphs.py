"""Decode rounds as CUDA graphs: one per exact width 1..max_width (64 rows), replayed per round.

A graph reads its inputs (tokens, positions, KV slots, block tables, sampling
parameters, penalty lists) from named static staging buffers (``runtime.Staging``:
pinned host memory mirrored on the device), so a replay needs only one small
host-to-device copy before it and the sampled tokens copied back after it. A
narrow round is never padded to a wider graph: every width has its own, so no row computes
for another and each kernel sees the round's exact rows (a lane's result does not depend on
them, gemv.cu / attention_decode.cu).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def decode_fields(max_lanes: int, bt_stride: int, pen_stride: int) -> dict[str, tuple[type, int]]:
    """The decode round's staging buffers, in upload order (``Staging.upload`` copies ranges of them).
    ``src``: per row, -1, or the row of the round before whose drawn token (still in ``out`` on the
    device) the row feeds instead of ``tokens`` (a round planned ahead, docs/CUDA.md). ``lane_first``: per
    row, its lane's first row (decode attention's DECODE_LR build)."""
    L = max_lanes
    return {
        "tokens": (np.int32, L), "src": (np.int32, L), "positions": (np.int32, L), "slots": (np.int32, L), "sample_pos": (np.int32, L),
        "lane_first": (np.int32, L),
        "seeds": (np.uint64, L), "params": (np.float32, 8 * L), "pen_num": (np.int32, L), "out": (np.int32, L),
        "block_tables": (np.int32, L * bt_stride), "pen_tokens": (np.int32, L * pen_stride),
        "pen_counts": (np.int32, L * pen_stride), "rope_positions": (np.int32, L),
    }  # fmt: skip


class GraphRunner:
    """Captures ``body(width)`` (every launch of a decode round of that width, reading ``staging``'s
    device buffers) once per width, and replays it."""

    def __init__(self, stream, staging, body: Callable[[int], None], max_width: int, *, eager: bool = False) -> None:
        self.stream, self.staging, self.body, self.max_width = stream, staging, body, max_width
        self.eager = eager  # run each round's launches directly (a round that reads back mid-way)
        self.graphs: dict = {}

    def capture(self) -> None:
        """(Re)capture the graph of every width 1..max_width: at load, and after a kernel setting
        changes (``CudaBackend.retune``). Each width runs once uncaptured first (loads every module)."""
        from engine.cu.runtime import Graph

        self.stream.synchronize()
        self.destroy()
        if self.eager:
            return
        v = self.staging.view
        v["params"][:] = 0.0  # greedy
        v["sample_pos"][:] = 1
        v["src"][:] = -1
        self.staging.upload(self.stream, "tokens", "block_tables")
        for m in range(1, self.max_width + 1):
            self.body(m)  # warm-up: writes only block 0's slots
            self.graphs[m] = Graph(self.stream, lambda m=m: self.body(m))
        self.stream.synchronize()

    recapture = capture

    def replay(self, width: int) -> None:
        """Launch the width-``width`` graph on the stream (the staging buffers already uploaded)."""
        if self.eager:
            self.body(width)
            return
        self.graphs[width].launch()

    def num_nodes(self, width: int) -> int:
        return 0 if self.eager else self.graphs[width].num_nodes

    def destroy(self) -> None:
        for g in self.graphs.values():
            g.destroy()
        self.graphs = {}
