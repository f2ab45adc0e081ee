"""The cpu backend's decode staging: a lane's context slots sliced from its blocks' slots."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu.backend import CpuBackend


def _backend(block_size: int) -> CpuBackend:
    b = CpuBackend.__new__(CpuBackend)  # no kernels needed: only the slot arithmetic
    b.block_size = block_size
    return b


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_lane_slots_are_the_slots_of_the_positions(block_size):
    rng = np.random.default_rng(block_size)
    b = _backend(block_size)
    for _ in range(200):
        table = [int(t) for t in rng.permutation(500)[: int(rng.integers(1, 20))]]
        end = int(rng.integers(1, len(table) * block_size + 1))
        start = int(rng.integers(0, end))
        want = b._slots(table, np.arange(start, end, dtype=np.int64))
        np.testing.assert_array_equal(b._lane_slots(table, start, end), want)
        np.testing.assert_array_equal(b._lane_slots(np.array(table), start, end), want)


def test_lane_slots_refuse_a_table_short_of_the_position():
    b = _backend(16)
    with pytest.raises(ValueError, match="does not reach position 32"):
        b._lane_slots([3, 4], 0, 33)
