"""The index arithmetic of the two wide-round kernels, replayed in Python on the CPU (their card tests
compare bits; these check the mappings they rest on, with no card):

* gemv_pair.cu's variants: the 64 threads of a warp pair copy a batch of x chunks into
  shared memory (``fill``), and each lane of both warps reads its fragment back at
  ``((u * 2 + h) G + j) 32 + lane``. Every entry a lane reads must hold exactly the chunk gemv_tc's
  own predicated load would give it (row 8 j + g, chunk 8 s + t + 4 h, zero past M, K and the steps),
  and every entry read must have been written once.
* attention_decode.cu's DECODE_LR build: each row's block decides whether it leads a group of its
  lane's rows, belongs to one (returns at once) or goes alone. Every row must be done by exactly
  one block, a group must be rows of one lane with one split size, and no group with a sliding
  window.
"""

from __future__ import annotations

import random

import pytest

from engine.cu.kernels import PAIR_TUNING, pair_smem


def pair_fill(U: int, G: int, M: int, K8: int, s0: int, s_end: int, s_unit: int = 8) -> dict[int, tuple]:
    """gemv_tc_main_pair's fill: entry -> (row, chunk) or 'zero', as the pair's threads copy them."""
    gm = min(G, (M + 7) >> 3)
    entries: dict[int, tuple] = {}
    for grp in (0, 1):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for q in range(U * G):
                slot = grp + 2 * q
                j, uh = slot % G, slot // G
                u, h = uh >> 1, uh & 1
                if j >= gm:
                    continue
                s = s0 + u * s_unit
                r, ch = 8 * j + g, s * 8 + t + 4 * h
                ok = s < s_end and ch < K8 and r < M
                e = slot * 32 + lane
                assert e not in entries, f"entry {e} written twice"
                entries[e] = (r, ch) if ok else "zero"
    return entries


CASES = [(u, g, m) for u, g in ((2, 2), (2, 4), (1, 8), (4, 2)) for m in (9, 16, 17, 31, 40, 64) if m <= 8 * g]


@pytest.mark.parametrize("U,G,M", CASES)
@pytest.mark.parametrize("K", [64, 520, 4096, 14336])
def test_a_pairs_x_buffer_holds_what_gemv_tc_would_load(U, G, M, K):
    K8 = K // 8
    steps = (K8 + 7) // 8
    for warp in range(8):
        for s0 in range(warp, steps, 8 * U):
            entries = pair_fill(U, G, M, K8, s0, steps)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for u in range(U):
                    for h in range(2):
                        for j in range(G):
                            if not (j == 0 or 8 * j < M):
                                continue  # neither loaded nor multiplied
                            s = s0 + 8 * u
                            ch = s * 8 + t + 4 * h
                            ok = s < steps and ch < K8 and 8 * j + g < M
                            got = entries[((u * 2 + h) * G + j) * 32 + lane]
                            assert got == ((8 * j + g, ch) if ok else "zero"), (warp, s0, lane, u, h, j)


def test_the_pair_buffers_fit_one_block_a_sm():
    for groups in (2, 4, 8):
        assert pair_smem(groups) + 9 * 1024 <= 227 * 1024  # dynamic buffers + the epilogue's static sums
    assert dict(PAIR_TUNING)["P64_U"] == 1  # 2 would take 256 KB


def split_chunk(ctx: int, splits: int = 32, sub: int = 64) -> int:
    c = -(-ctx // splits)
    return max(sub, -(-c // sub) * sub)


def lane_blocks(positions: list[int], lane_first: list[int], lr: int, window: int) -> list[tuple[int, int]]:
    """decode_attn's (first row, rows) a block does, for every row's block that does not return."""
    M, done = len(positions), []
    for m in range(M):
        f = lane_first[m]
        gs = f + (m - f) // lr * lr
        ge = gs + 1
        if window <= 0:
            c0 = split_chunk(positions[gs] + 1)
            while ge < gs + lr and ge < M and lane_first[ge] == f and split_chunk(positions[ge] + 1) == c0:
                ge += 1
        if m != gs and m < ge:
            continue
        done.append((m, ge - gs if m == gs else 1))
    return done


@pytest.mark.parametrize("lr", [2, 4, 8, 16])
@pytest.mark.parametrize("window", [0, 100])
def test_every_row_is_one_blocks_and_a_group_is_one_lane_of_one_split_size(lr, window):
    rnd = random.Random(lr * 7 + window)
    for _ in range(200):
        positions, lane_first, lane_of = [], [], []
        for lane in range(rnd.randint(1, 12)):
            n, start = rnd.randint(1, 9), rnd.choice([0, 5, 2040, 2045, 4090, rnd.randint(0, 9000)])
            first = len(positions)
            for j in range(n):
                positions.append(start + j)
                lane_first.append(first)
                lane_of.append(lane)
        blocks = lane_blocks(positions, lane_first, lr, window)
        covered = [r for m, n in blocks for r in range(m, m + n)]
        assert sorted(covered) == list(range(len(positions)))
        for m, n in blocks:
            rows = range(m, m + n)
            assert n <= lr and len({lane_of[r] for r in rows}) == 1
            assert len({split_chunk(positions[r] + 1) for r in rows}) == 1
            assert n == 1 or window <= 0
    # A plain round (one row a lane) is a block a row, as without the build.
    assert lane_blocks([10, 20, 30], [0, 1, 2], lr, window) == [(0, 1), (1, 1), (2, 1)]
