"""attention_decode.cu's DECODE_LR build (``Kernels(decode_lanes=True)``: a lane's verify rows share one
block and read their keys once) gives every row the bits of the plain build, which gives each row a
block of its own: lanes of 1 to 9 rows, rows that straddle a split-size change (a context crossing
2,048 keys), lanes of one row between them, the scale / soft-cap / sinks options, and a sliding
window (no sharing there). The pages past each lane's last key hold NaNs, so a row that read past
its lane's context would show it. Rounds below ``DECODE_LANES_FROM`` rows run the plain build, and a
call without ``lane_first`` too. Skipped without a card, but for the config keys' wiring."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import Dev, gpu

rng = np.random.default_rng(11)
SHAPES = [(64, 4), (128, 1), (128, 4), (128, 7), (128, 8)]  # (head_dim, query heads a KV head)


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def kerns(dev):
    """(plain, lanes) Kernels per shape."""
    from engine.cu.kernels import Kernels

    return {s: (Kernels(*s), Kernels(*s, decode_lanes=True)) for s in SHAPES}


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


def round_of(lanes, bs):
    """(rows as (lane, position), block tables per row, lane_first per row, pages needed) for lanes of
    (context of the first row, rows)."""
    need = [-(-(c + r - 1) // bs) for c, r in lanes]
    perm, o, tables = rng.permutation(sum(need) + 1), 0, []
    for n in need:
        tables.append(perm[o : o + n])
        o += n
    rows, first = [], []
    for i, (c, r) in enumerate(lanes):
        f = len(rows)
        for j in range(r):
            rows.append((i, c - 1 + j))
            first.append(f)
    return rows, tables, np.array(first, np.int32), sum(need) + 1


LANES = [(5, 5), (700, 9), (1, 1), (2046, 5), (2047, 2), (300, 4), (3000, 1), (4094, 4), (90, 3), (64, 8)]


@gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opts", ["plain", "softcap+sinks", "window"])
def test_a_lanes_rows_get_the_bits_of_a_block_each(kerns, stream, shape, opts):
    from engine.cu.kernels import DECODE_SPLITS, AttnArgs, attention_scales

    d, g = shape
    plain, lanes_k = kerns[shape]
    kvh, bs, L, layer = 2, 16, 2, 1
    h = kvh * g
    dv = Dev()
    rows, tables, first, nb = round_of(LANES, bs)
    m = len(rows)
    stride = max(len(t) for t in tables)
    bt = np.zeros((m, stride), np.int32)
    for row, (i, _) in enumerate(rows):
        bt[row, : len(tables[i])] = tables[i]
    pos = np.array([p for _, p in rows], np.int32)
    cache = np.random.default_rng(1).standard_normal((nb, L, 2, bs, kvh, d)).astype(np.float32)
    for i, (c, r) in enumerate(LANES):  # the keys past a lane's last row: NaN (stale page space)
        end = c + r - 1
        for t in range(end, len(tables[i]) * bs):
            cache[tables[i][t // bs], :, :, t % bs] = np.nan
    q = np.random.default_rng(2).standard_normal((m, h, d)).astype(np.float32)
    scale, softcap = (0.09, 30.0) if opts == "softcap+sinks" else (None, None)
    s_l2, c_l2 = attention_scales(d, scale, softcap)
    sinks = dv.put((rng.standard_normal(h) * 2).astype(np.float32)).ptr if opts == "softcap+sinks" else 0
    args = AttnArgs(s_l2, c_l2, 100 if opts == "window" else 0, sinks)
    g_cache, g_q, g_pos, g_bt, g_first = dv.put(cache, True), dv.put(q, True), dv.put(pos), dv.put(bt), dv.put(first)
    o_part = dv.put(np.zeros(m * h * DECODE_SPLITS * d, np.float32))
    ml = dv.put(np.zeros(m * h * DECODE_SPLITS * 2, np.float32))
    base, lstride = g_cache.ptr + layer * 2 * bs * kvh * d * 2, L * 2 * bs * kvh * d
    outs = []
    for k in (plain, lanes_k):
        g_out = dv.put(np.full((m, h * d), 0x7FC0, np.uint16))
        k.decode_attention(stream, g_q.ptr, g_pos.ptr, g_bt.ptr, stride, base, lstride, bs, kvh, o_part.ptr, ml.ptr,
                           g_out.ptr, m, args=args, lane_first=g_first.ptr)  # fmt: skip
        stream.synchronize()
        outs.append(g_out.get())
    assert lanes_k._decode_lanes is not None
    from engine.backends.cuda.weights import from_bf16

    assert np.isfinite(from_bf16(outs[0])).all()
    np.testing.assert_array_equal(outs[1], outs[0])


@gpu
def test_narrow_rounds_and_calls_without_lane_first_run_the_plain_build(kerns, stream, monkeypatch):
    from engine.cu.kernels import DECODE_LANES_FROM

    _, k = kerns[(128, 4)]
    calls = []
    monkeypatch.setattr(k, "_decode_attn", lambda *a, **kw: calls.append(("plain", a[1], "lane_first" in kw)))
    monkeypatch.setattr(k, "_decode_lanes", lambda *a, **kw: calls.append(("lanes", a[1], "lane_first" in kw)))
    for rows, lf in ((DECODE_LANES_FROM - 1, 0x100), (DECODE_LANES_FROM, 0x100), (40, 0)):
        k.decode_attention(stream, 1, 2, 3, 4, 5, 6, 16, 2, 7, 8, 9, rows, lane_first=lf)
    assert calls == [("plain", (2, DECODE_LANES_FROM - 1, 32), False), ("lanes", (2, DECODE_LANES_FROM, 32), True),
                     ("plain", (2, 40, 32), False)]  # fmt: skip


def test_the_keys_reach_the_kernels():
    """``cuda.gemv_pair`` (on) and ``cuda.decode_lanes`` (off: slower on the card) reach CudaTuning and the
    backend's ``Kernels`` (no card)."""
    import inspect

    from engine.backends.cuda import backend
    from engine.config import CudaTuning
    from ignis_site import config

    for key, field, default in (("cuda.gemv_pair", "gemv_pair", True), ("cuda.decode_lanes", "decode_lanes", False)):
        assert config.FIELDS[key].default is default and getattr(CudaTuning(), field) is default
        env = "IGNIS_" + key.upper().replace(".", "_")
        values, _ = config.resolve(environ={env: "off" if default else "on"})
        assert getattr(CudaTuning(**config.cuda_tuning_dict(values)), field) is not default
        assert f"{field}=t.{field}" in inspect.getsource(backend.CudaBackend._kernels)
