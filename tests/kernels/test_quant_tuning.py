"""engine.cu.quant's tunings of gemv_q.cu, on the CPU: the defines a format's GEMV is compiled with
(another set is another cubin and kernel-cache entry, so the committed tunings carry no experiment's
switch) and the shared memory of its stage slots, which gemv_q.cu's static_assert checks against
the same arithmetic at compile time."""

from __future__ import annotations

import pytest

from engine.cu.quant import FP8, FP8_FORMATS, FP8B, QUANT_FORMATS, TC_ROWS, gemv_q_defines, stage_smem


@pytest.mark.parametrize("fmt", [*QUANT_FORMATS, *FP8_FORMATS])
def test_committed_tunings_carry_no_experiment_switch(fmt):
    defines, smem = gemv_q_defines(fmt)
    d = dict(defines)
    assert not {"QUF", "QACT8", "QPROBE"} & set(d), d
    assert d["QSMEM"] == smem == stage_smem(fmt, d["QU"], d["QNST"])
    assert d["QKH"] == 1


def test_q8_0_runs_four_blocks_an_sm():
    d = dict(gemv_q_defines("Q8_0")[0])
    assert (d["QU"], d["QMINB"], d["QNST"]) == (2, 4, 2)


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("units", [2, 4, 8])
def test_slot_rows_fall_on_distinct_banks(fmt, units):
    _, qk, bb = QUANT_FORMATS[fmt]
    if qk == 256 and units % 4:
        pytest.skip("K-quants take whole super-blocks a warp")
    rs = stage_smem(fmt, units, 1) // TC_ROWS
    piece = 8 * units * 64 // qk * bb
    assert rs >= -(-piece // 16) * 16 + 32 and rs % 16 == 0  # the piece and its two partial 16-byte ends
    if fmt in ("Q4_K", "Q5_K"):  # 8-byte reads: a half-warp's 4 rows on 4 disjoint 8-bank ranges
        assert rs % 128 == 32
        assert sorted((g * rs // 4) % 32 for g in range(4)) == [0, 8, 16, 24]
    else:  # 4-byte reads: 8 rows of 4 banks each
        assert (rs // 16) % 2 == 1
        assert sorted((g * rs // 4) % 32 for g in range(8)) == list(range(0, 32, 4))


def test_int8_activations_refuse_fp8():
    with pytest.raises(ValueError, match="int8-activation"):
        gemv_q_defines(FP8, act8=True)
    with pytest.raises(ValueError, match="int8-activation"):
        gemv_q_defines(FP8B, act8=True)
    assert dict(gemv_q_defines("Q4_K", act8=True)[0])["QACT8"] == 1
