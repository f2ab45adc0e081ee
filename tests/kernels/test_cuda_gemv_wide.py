"""The wide bf16 GEMVs that are not gemv_tc's own variants give every output gemv_tc's bits:
gemv_wide.cu (a block of 128 weight rows reads x once; engine/cu/kernels.py ``wide_min_n``) and
gemv_pair.cu's variants (``gemv_pair``: two 16-row tiles a block share x through shared memory).
For each epilogue (store, acc with the next norm's xw and ss partials, the fused RMSNorm scale in,
SwiGLU, GeGLU, rope with the KV write and partial rotary), at widths 9..64 and matrix sizes that
leave a block part-full (an odd tile count leaves a pair's second tile empty), against the same
Kernels call with both off (gemv_tc's 16 / 32 / 64-row variants), and against numpy. Skipped
without a card."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import Dev, requires_cuda

pytestmark = requires_cuda

rng = np.random.default_rng(7)
WIDTHS = (9, 16, 17, 31, 40, 64)


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module", params=["wide", "pair"])
def pair(dev, request):
    """(gemv_tc only, gemv_wide for every matrix or the paired variants), head_dim 128, 4 query heads a
    KV head."""
    from engine.cu.kernels import Kernels

    # pair_from 9: every paired variant (the backend's default takes only the 64-row one, from 33 rows)
    other = Kernels(128, 4, wide_min_n=1) if request.param == "wide" else Kernels(128, 4, gemv_pair=True, pair_from=9)
    return Kernels(128, 4), other


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


def bf(a):
    from engine.backends.cuda.weights import from_bf16, to_bf16

    return from_bf16(to_bf16(a)).reshape(np.shape(a))


def test_the_wide_kernels_are_compiled_only_when_asked(pair):
    plain, other = pair
    assert not plain._tcw and not plain._tcp
    assert len(other._tcw) + len(other._tcp) == 5 * 3


@pytest.mark.parametrize("n,k", [(1000, 4096), (384, 1032), (130, 520), (16, 64)])
@pytest.mark.parametrize("rows", WIDTHS)
def test_store_and_acc_with_norms_are_gemv_tcs_bits(pair, stream, rows, n, k):
    d = Dev()
    x = bf(rng.standard_normal((rows, k)).astype(np.float32))
    w = bf((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    base = rng.standard_normal((rows, n)).astype(np.float32)
    nw = bf((1 + 0.3 * rng.standard_normal(n)).astype(np.float32))
    ss_parts = (rng.random((rows, 3)) * k).astype(np.float32)
    g_x, g_w, g_b, g_nw, g_ss = d.put(x, True), d.put(w, True), d.put(bias), d.put(nw, True), d.put(ss_parts)
    outs = []
    for kern in pair:
        g_o1 = d.put(np.full((rows, n), np.nan, np.float32))
        kern.linear(stream, g_x.ptr, g_w.ptr, g_b.ptr, g_o1.ptr, rows, n, k, ss_in=(g_ss.ptr, 3), eps=1e-5)
        g_o2 = d.put(base)
        g_xw = d.put(np.full((rows, n), 0x7FC0, np.uint16))
        nparts = -(-n // 16)
        g_so = d.put(np.full(rows * nparts, np.nan, np.float32))
        kern.linear(stream, g_x.ptr, g_w.ptr, 0, g_o2.ptr, rows, n, k, accumulate=True,
                    norm_out=(g_nw.ptr, g_xw.ptr, g_so.ptr))  # fmt: skip
        stream.synchronize()
        outs.append([g.get() for g in (g_o1, g_o2, g_xw, g_so)])
    for name, a, b in zip(("store", "acc", "xw", "ss_out"), *outs):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    scale = 1 / np.sqrt(ss_parts.astype(np.float64).sum(-1, keepdims=True) / k + 1e-5)
    ref = (x.astype(np.float64) @ w.T) * scale + bias
    assert np.linalg.norm(outs[1][0] - ref) / np.linalg.norm(ref) < 1e-4


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", WIDTHS)
def test_gate_up_epilogues_are_gemv_tcs_bits(pair, stream, rows, act):
    from engine.backends.cuda.weights import interleave_gate_up

    d = Dev()
    inter, k = 1400, 1024
    x = bf(rng.standard_normal((rows, k)).astype(np.float32))
    gate = bf((rng.standard_normal((inter, k)) / np.sqrt(k)).astype(np.float32))
    up = bf((rng.standard_normal((inter, k)) / np.sqrt(k)).astype(np.float32))
    g_x, g_w = d.put(x, True), d.put(interleave_gate_up(gate, up), True)
    ss_parts = (rng.random((rows, 5)) * k).astype(np.float32)
    g_ss = d.put(ss_parts)
    outs = []
    for kern in pair:
        g_act = d.put(np.full((rows, inter), 0x7FC0, np.uint16))
        g_gu = d.put(np.full((rows, 2 * inter), np.nan, np.float32))
        kern.gate_up_act(stream, g_x.ptr, g_w.ptr, g_gu.ptr, g_act.ptr, rows, inter, k, ss_in=(g_ss.ptr, 5),
                         eps=1e-6, fn=act)  # fmt: skip
        stream.synchronize()
        outs.append(g_act.get())
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("rotary", [128, 64])
@pytest.mark.parametrize("rows", WIDTHS)
def test_rope_epilogue_is_gemv_tcs_bits(pair, stream, rows, rotary):
    from engine.backends.cuda.weights import interleave_rope

    d = Dev()
    dh, kvh, heads, bs, nb, hid = 128, 2, 8, 16, 12, 512
    n = (heads + 2 * kvh) * dh
    x = bf(rng.standard_normal((rows, hid)).astype(np.float32))
    w = bf((rng.standard_normal((n, hid)) / np.sqrt(hid)).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32)
    pos = rng.integers(0, 5000, rows).astype(np.int32)
    slots = rng.choice(nb * bs, rows, replace=False).astype(np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    inv = np.concatenate([inv, np.zeros(dh // 2 - rotary // 2, np.float32)])
    ss_parts = (rng.random((rows, 2)) * hid).astype(np.float32)
    g_x, g_w = d.put(x, True), d.put(interleave_rope(w, dh, rotary), True)
    g_b, g_pos, g_slots, g_inv, g_ss = (d.put(a) for a in (interleave_rope(b, dh, rotary), pos, slots, inv, ss_parts))
    cache0 = bf(rng.standard_normal((nb, 2, bs, kvh, dh)).astype(np.float32))
    outs = []
    for kern in pair:
        g_cache, g_q = d.put(cache0, True), d.put(np.full((rows, heads, dh), 0x7FC0, np.uint16))
        kern.qkv_rope(stream, g_x.ptr, g_w.ptr, g_b.ptr, g_q.ptr, rows, heads, kvh, hid, g_pos.ptr, g_slots.ptr,
                      g_inv.ptr, g_cache.ptr, bs, 2 * bs * kvh * dh, ss_in=(g_ss.ptr, 2), eps=1e-6,
                      rotary_dim=rotary, factor=1.25)  # fmt: skip
        stream.synchronize()
        outs.append((g_q.get(), g_cache.get()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_a_rows_bits_do_not_depend_on_the_width_or_its_place(pair, stream):
    """1..8 rows run gemv_tc, 9..64 gemv_wide or the paired variants: a row's output is the same at every
    width and place."""
    d = Dev()
    _, wide = pair
    n, k = 3000, 2048
    x = bf(rng.standard_normal((64, k)).astype(np.float32))
    g_w = d.put(bf((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)), True)

    def run(xs):
        g_o = d.put(np.full((len(xs), n), np.nan, np.float32))
        wide.linear(stream, d.put(np.ascontiguousarray(xs), True).ptr, g_w.ptr, 0, g_o.ptr, len(xs), n, k)
        stream.synchronize()
        return g_o.get().reshape(len(xs), n)

    full = run(x)
    for rows in (1, 5, 8, 9, 16, 33, 63):
        np.testing.assert_array_equal(run(x[:rows]), full[:rows], err_msg=f"width {rows}")
    perm = rng.permutation(64)
    np.testing.assert_array_equal(run(x[perm]), full[perm])
