"""Every kernel in engine/cu against a numpy reference, on fresh random inputs of
several shapes (bf16 tolerances). Skipped without PyCUDA and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = requires_cuda


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def kern(dev):
    from engine.cu.kernels import Kernels

    ks = {(d, g): Kernels(d, g) for d in (64, 128) for g in (1, 4, 7)}
    ks[(256, 2)] = Kernels(256, 2)  # gemma's head size
    return ks


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


rng = np.random.default_rng()


def bf(a):
    """Round to bf16 and back (what the device sees)."""
    from engine.backends.cuda.weights import from_bf16, to_bf16

    return from_bf16(to_bf16(a)).reshape(np.shape(a))


_live: list = []  # device arrays stay alive until the test's kernels have run


@pytest.fixture(autouse=True)
def _release():
    yield
    _live.clear()


def put(a, bf16=False):
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import to_bf16

    arr = to_bf16(a) if bf16 else np.ascontiguousarray(a)
    g = ga.to_gpu(arr)
    _live.append(g)
    return g


def get(g, bf16=False, shape=None):
    from engine.backends.cuda.weights import from_bf16

    h = g.get()
    h = from_bf16(h) if bf16 else h
    return h.reshape(shape) if shape is not None else h


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) + 1e-30))


def test_embed(kern, stream):
    k = kern[(128, 4)]
    for vocab, hid, rows in [(1000, 576, 7), (50, 4096, 33)]:
        table = bf(rng.standard_normal((vocab, hid)).astype(np.float32))
        tok = rng.integers(0, vocab, rows).astype(np.int32)
        g_tab, g_tok, g_x = put(table, True), put(tok), put(np.full((rows, hid), np.nan, np.float32))
        k.embed(stream, g_tok.ptr, g_tab.ptr, g_x.ptr, rows, hid)
        stream.synchronize()
        np.testing.assert_array_equal(get(g_x), table[tok])


def test_rmsnorm_and_swiglu(kern, stream):
    k = kern[(128, 4)]
    for rows, hid in [(1, 576), (5, 4096), (300, 1024)]:
        x = (rng.standard_normal((rows, hid)) * 3).astype(np.float32)
        w = bf(rng.standard_normal(hid).astype(np.float32))
        g_x, g_w, g_o = put(x), put(w, True), put(np.zeros((rows, hid), np.uint16))
        k.rmsnorm(stream, g_x.ptr, g_w.ptr, g_o.ptr, rows, hid, 1e-5)
        stream.synchronize()
        ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
        got = get(g_o, True, (rows, hid))
        assert rel_err(got, ref) < 8e-3
        # With L2-prefetch blocks (here over the input itself, any odd size): the same output.
        g_o2 = put(np.zeros((rows, hid), np.uint16))
        k.rmsnorm(stream, g_x.ptr, g_w.ptr, g_o2.ptr, rows, hid, 1e-5, prefetch=(g_x.ptr, x.nbytes - 40))
        stream.synchronize()
        np.testing.assert_array_equal(get(g_o2, True, (rows, hid)), got)
    for rows, inter in [(1, 1536), (9, 14336)]:
        gu = (rng.standard_normal((rows, 2 * inter)) * 2).astype(np.float32)
        g, u = gu[:, :inter], gu[:, inter:]
        ref = g / (1 + np.exp(-g)) * u
        g_gu, g_o = put(gu), put(np.zeros((rows, inter), np.uint16))
        k.swiglu(stream, g_gu.ptr, g_o.ptr, inter, rows)
        stream.synchronize()
        assert rel_err(get(g_o, True, (rows, inter)), ref) < 8e-3
        # interleaved layout: 8 gate columns, then the same 8 up columns
        gi = np.stack([g.reshape(rows, -1, 8), u.reshape(rows, -1, 8)], 2).reshape(rows, 2 * inter)
        g_gu, g_o = put(np.ascontiguousarray(gi)), put(np.zeros((rows, inter), np.uint16))
        k.swiglu(stream, g_gu.ptr, g_o.ptr, inter, rows, interleaved=True)
        stream.synchronize()
        assert rel_err(get(g_o, True, (rows, inter)), ref) < 8e-3


@pytest.mark.parametrize(
    "rows,inter,k_",
    [(1, 1408, 512), (3, 14336, 4096), (8, 64, 200), (12, 1536, 576), (29, 1408, 512), (40, 14336, 4096),
     (64, 200, 136), (72, 64, 200)],
)  # fmt: skip
def test_gate_up_act(kern, stream, rows, inter, k_):
    """The gate_up GEMV with SwiGLU in its epilogue (rows <= 64) / GEMM + swiglu (wider), on the
    interleaved gate|up matrix, against numpy."""
    from engine.backends.cuda.weights import interleave_gate_up

    k = kern[(128, 4)]
    x = bf(rng.standard_normal((rows, k_)).astype(np.float32))
    gate = bf((rng.standard_normal((inter, k_)) / np.sqrt(k_)).astype(np.float32))
    up = bf((rng.standard_normal((inter, k_)) / np.sqrt(k_)).astype(np.float32))
    g, u = x.astype(np.float64) @ gate.T, x.astype(np.float64) @ up.T
    ref = g / (1 + np.exp(-g)) * u
    w = interleave_gate_up(gate, up)
    g_act = put(np.full((rows, inter), 0x7FC0, np.uint16))  # bf16 NaN
    g_gu = put(np.full((rows, 2 * inter), np.nan, np.float32))
    k.gate_up_act(stream, put(x, True).ptr, put(w, True).ptr, g_gu.ptr, g_act.ptr, rows, inter, k_)
    stream.synchronize()
    assert rel_err(get(g_act, True, (rows, inter)), ref) < 8e-3


@pytest.fixture(scope="module")
def kern_by_u2(dev):
    """Kernel objects of their own (the shared ``kern`` keeps its defaults): every matrix on
    gemv_tc's 4-step variant (False) or on its 2-step variant (True)."""
    from engine.cu.kernels import Kernels

    return {False: Kernels(128, 4, u2_below=0), True: Kernels(128, 4, u2_below=1 << 62)}


@pytest.mark.parametrize("u2", [False, True])
@pytest.mark.parametrize(
    "rows,n,k_",
    [(1, 4096, 4096), (2, 300, 1408), (3, 1001, 576), (8, 256, 14336), (5, 77, 8), (7, 33, 200), (16, 8, 64),
     (1, 24, 1032), (9, 300, 1408), (13, 1001, 576), (24, 256, 14336), (33, 77, 8), (40, 4096, 4096),
     (57, 33, 200), (64, 1000, 1032), (65, 300, 512)],
)  # fmt: skip
def test_linear_gemv_and_gemm(kern_by_u2, stream, rows, n, k_, u2):
    _check_linear(kern_by_u2[u2], stream, rows, n, k_)


@pytest.mark.parametrize("u2", [False, True])
def test_gemv_tc_width_invariant(kern_by_u2, stream, u2):
    """A row's output of gemv_tc is bitwise the same whatever the other rows, its place among them
    and the width are (every variant: 1..8 rows, 16, 32, 64)."""
    k = kern_by_u2[u2]
    n, k_ = 1000, 4096
    x = bf(rng.standard_normal((64, k_)).astype(np.float32))
    w = put(bf((rng.standard_normal((n, k_)) / np.sqrt(k_)).astype(np.float32)), True)

    def run(xs):
        g_o = put(np.full((len(xs), n), np.nan, np.float32))
        k.linear(stream, put(np.ascontiguousarray(xs), True).ptr, w.ptr, 0, g_o.ptr, len(xs), n, k_)
        stream.synchronize()
        return get(g_o).reshape(len(xs), n)

    full = run(x)
    for rows in (1, 3, 8, 9, 16, 17, 31, 32, 40, 63):
        np.testing.assert_array_equal(run(x[:rows]), full[:rows], err_msg=f"width {rows}")
    # rows moved to other places (other mma columns and row groups) keep their bits
    perm = rng.permutation(64)
    np.testing.assert_array_equal(run(x[perm]), full[perm])
    np.testing.assert_array_equal(run(x[perm[:40]]), full[perm[:40]])


def _norm_ref(h, nw, eps=1e-5):
    return h / np.sqrt((h.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * nw


def test_fused_rmsnorm_chain(kern, stream):
    """Decode rounds fold RMSNorm into the GEMVs: embed and accumulate-mode GEMVs write bf16(h * w) and
    per-block sums of h^2; the next GEMV (plain, SwiGLU) scales its rows. Against numpy, and a row's
    results are bitwise the same at widths 1, 8, 13 and 64."""
    from engine.backends.cuda.weights import interleave_gate_up

    k = kern[(128, 4)]
    hid, n_in, inter, vocab, eps = 1024, 768, 1408, 500, 1e-5
    tab = bf(rng.standard_normal((vocab, hid)).astype(np.float32))
    w_o = bf((rng.standard_normal((hid, n_in)) / np.sqrt(n_in)).astype(np.float32))
    nw = bf((1 + 0.3 * rng.standard_normal(hid)).astype(np.float32))
    w_q = bf((rng.standard_normal((300, hid)) / np.sqrt(hid)).astype(np.float32))
    gate = bf((rng.standard_normal((inter, hid)) / np.sqrt(hid)).astype(np.float32))
    up = bf((rng.standard_normal((inter, hid)) / np.sqrt(hid)).astype(np.float32))
    g_tab, g_wo, g_nw, g_wq = put(tab, True), put(w_o, True), put(nw, True), put(w_q, True)
    g_gu = put(interleave_gate_up(gate, up), True)
    toks = rng.integers(0, vocab, 64).astype(np.int32)
    a_in = bf(rng.standard_normal((64, n_in)).astype(np.float32))
    res = {}
    for rows in (1, 8, 13, 64):
        g_x, g_xw = put(np.full((rows, hid), np.nan, np.float32)), put(np.full((rows, hid), 0x7FC0, np.uint16))
        g_ss = put(np.full(rows * (hid // 16), np.nan, np.float32))
        # embed: x, xw, one partial per row
        nparts = k.embed(stream, put(toks[:rows]).ptr, g_tab.ptr, g_x.ptr, rows, hid, norm_out=(g_nw.ptr, g_xw.ptr,
                         g_ss.ptr))  # fmt: skip
        stream.synchronize()
        h = tab[toks[:rows]]
        np.testing.assert_array_equal(get(g_x, shape=(rows, hid)), h)
        assert nparts == 1
        np.testing.assert_allclose(get(g_ss)[:rows], (h.astype(np.float64) ** 2).sum(-1), rtol=1e-5)
        np.testing.assert_array_equal(get(g_xw, True, (rows, hid)), bf(h * nw))
        g_out = put(np.full((rows, 300), np.nan, np.float32))
        k.linear(stream, g_xw.ptr, g_wq.ptr, 0, g_out.ptr, rows, 300, hid, ss_in=(g_ss.ptr, 1), eps=eps)
        stream.synchronize()
        emb_out = get(g_out, shape=(rows, 300))
        assert rel_err(emb_out, _norm_ref(h, nw, eps) @ w_q.T) < 8e-3
        # accumulate-mode producer: x += a @ w_o.T, then xw and ceil(hid / 16) partials per row
        nparts = k.linear(stream, put(a_in[:rows], True).ptr, g_wo.ptr, 0, g_x.ptr, rows, hid, n_in, accumulate=True,
                          norm_out=(g_nw.ptr, g_xw.ptr, g_ss.ptr))  # fmt: skip
        stream.synchronize()
        assert nparts == hid // 16
        h2 = get(g_x, shape=(rows, hid))
        assert rel_err(h2, h + a_in[:rows].astype(np.float64) @ w_o.T) < 1e-4
        np.testing.assert_array_equal(get(g_xw, True, (rows, hid)), bf(h2 * nw))
        parts = get(g_ss).reshape(rows, nparts)
        np.testing.assert_allclose(parts.sum(-1), (h2.astype(np.float64) ** 2).sum(-1), rtol=1e-5)
        # consumers: plain and SwiGLU epilogue
        g_out = put(np.full((rows, 300), np.nan, np.float32))
        k.linear(stream, g_xw.ptr, g_wq.ptr, 0, g_out.ptr, rows, 300, hid, ss_in=(g_ss.ptr, nparts), eps=eps)
        g_act = put(np.full((rows, inter), 0x7FC0, np.uint16))
        k.gate_up_act(stream, g_xw.ptr, g_gu.ptr, 0, g_act.ptr, rows, inter, hid, ss_in=(g_ss.ptr, nparts), eps=eps)
        stream.synchronize()
        xn = _norm_ref(h2, nw, eps)
        out = get(g_out, shape=(rows, 300))
        assert rel_err(out, xn @ w_q.T) < 8e-3
        gg, uu = xn @ gate.T, xn @ up.T
        act = get(g_act, True, (rows, inter))
        assert rel_err(act, gg / (1 + np.exp(-gg)) * uu) < 1.5e-2
        res[rows] = (emb_out, h2, parts, out, act)
    for rows in (8, 13, 64):
        for a, b in zip(res[1], res[rows]):
            np.testing.assert_array_equal(a[0], b[0])
    for a, b in zip(res[8], res[64]):
        np.testing.assert_array_equal(a, b[:8])


@pytest.mark.parametrize("d,g,bias", [(64, 4, True), (128, 4, False), (128, 1, True)])
def test_qkv_rope_epilogue(kern, stream, d, g, bias):
    """The q|k|v GEMV with fused RMSNorm scale and rope + KV write in its epilogue (gemv_tc mode 3)
    against numpy; row 0 is bitwise the same at widths 1, 7, 20 and 64."""
    from engine.backends.cuda.weights import interleave_rope

    k = kern[(d, g)]
    kvh, bs, L, nb, hid, eps = 2, 16, 3, 20, 512, 1e-6
    h = kvh * g
    n = (h + 2 * kvh) * d
    hres = (rng.standard_normal((64, hid)) * 2).astype(np.float32)
    nw = bf((1 + 0.3 * rng.standard_normal(hid)).astype(np.float32))
    w = bf((rng.standard_normal((n, hid)) / np.sqrt(hid)).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    ss = (hres.astype(np.float64) ** 2).sum(-1)
    parts = np.stack([ss * 0.25, ss * 0.5, ss * 0.25], -1).astype(np.float32)  # any split of the sum
    pos = rng.integers(0, 5000, 64).astype(np.int32)
    slots = rng.choice(nb * bs, 64, replace=False).astype(np.int32)
    inv = _inv_freq(d)
    g_w, g_x = put(interleave_rope(w, d), True), put(bf(hres * nw), True)
    g_b = put(interleave_rope(b, d)) if bias else None
    g_pos, g_slots, g_inv, g_parts = put(pos), put(slots), put(inv), put(parts)
    layer, stride = 1, L * 2 * bs * kvh * d
    qs, caches = {}, {}
    for rows in (1, 7, 20, 64):
        cache = _cache_setup(nb, L, bs, kvh, d)
        g_cache, g_q = put(cache, True), put(np.full((rows, h, d), 0x7FC0, np.uint16))
        k.qkv_rope(stream, g_x.ptr, g_w.ptr, g_b.ptr if bias else 0, g_q.ptr, rows, h, kvh, hid, g_pos.ptr,
                   g_slots.ptr, g_inv.ptr, g_cache.ptr + layer * 2 * bs * kvh * d * 2, bs, stride,
                   ss_in=(g_parts.ptr, 3), eps=eps)  # fmt: skip
        stream.synchronize()
        qkv = _norm_ref(hres[:rows], nw, eps) @ w.T + (b if bias else 0)
        ang = pos[:rows, None].astype(np.float32) * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

        def rot(x, cos=cos, sin=sin):
            a, bb = x[..., : d // 2], x[..., d // 2 :]
            return np.concatenate([a * cos - bb * sin, bb * cos + a * sin], -1)

        x = qkv.reshape(rows, h + 2 * kvh, d)
        qs[rows] = get(g_q, True, (rows, h, d))
        assert rel_err(qs[rows], rot(x[:, :h])) < 8e-3
        got = get(g_cache, True, cache.shape)
        blk, off = slots[:rows] // bs, slots[:rows] % bs
        assert rel_err(got[blk, layer, 0, off], rot(x[:, h : h + kvh])) < 8e-3
        assert rel_err(got[blk, layer, 1, off], x[:, h + kvh :]) < 8e-3
        mask = np.ones(cache.shape[:4], bool)
        mask[blk, layer, :, off] = False
        np.testing.assert_array_equal(got[mask], cache[mask])
        caches[rows] = got[blk[0], layer, :, off[0]]
    for rows in (7, 20, 64):
        np.testing.assert_array_equal(qs[1][0], qs[rows][0])
        np.testing.assert_array_equal(caches[1], caches[rows])
    np.testing.assert_array_equal(qs[20], qs[64][:20])


def _check_linear(k, stream, rows, n, k_):
    x = bf(rng.standard_normal((rows, k_)).astype(np.float32))
    w = bf((rng.standard_normal((n, k_)) / np.sqrt(k_)).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    base = rng.standard_normal((rows, n)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    g_x, g_w, g_b = put(x, True), put(w, True), put(bias)
    g_o = put(np.full((rows, n), np.nan, np.float32))
    k.linear(stream, g_x.ptr, g_w.ptr, g_b.ptr, g_o.ptr, rows, n, k_)
    stream.synchronize()
    assert rel_err(get(g_o), ref + bias) < 1e-4
    g_o = put(base)
    k.linear(stream, g_x.ptr, g_w.ptr, 0, g_o.ptr, rows, n, k_, accumulate=True)
    stream.synchronize()
    assert rel_err(get(g_o), ref + base) < 1e-4


@pytest.mark.parametrize("rows,n,k_", [(65, 200, 136), (128, 384, 512), (300, 128, 4096), (2048, 512, 1024)])
def test_gemm_tensor_cores(kern, stream, rows, n, k_):
    k = kern[(128, 4)]
    x = bf(rng.standard_normal((rows, k_)).astype(np.float32))
    w = bf((rng.standard_normal((n, k_)) / np.sqrt(k_)).astype(np.float32))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    g_o = put(np.full((rows, n), np.nan, np.float32))
    k.linear(stream, put(x, True).ptr, put(w, True).ptr, 0, g_o.ptr, rows, n, k_)
    stream.synchronize()
    assert rel_err(get(g_o), ref) < 1e-4


def _cache_setup(num_blocks, L, bs, kvh, d):
    cache = bf(rng.standard_normal((num_blocks, L, 2, bs, kvh, d)).astype(np.float32))
    return cache


def _inv_freq(d, theta=10000.0):
    return (1.0 / theta ** (np.arange(0, d, 2) / d)).astype(np.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,g", [(64, 4), (128, 1), (128, 7)])
def test_rope_kv_write(kern, stream, d, g, interleaved):
    from engine.backends.cuda.weights import interleave_rope

    k = kern[(d, g)]
    kvh, rows, bs, L, nb = 2, 6, 16, 3, 20
    h = kvh * g
    qkv = rng.standard_normal((rows, (h + 2 * kvh) * d)).astype(np.float32)
    pos = rng.integers(0, 5000, rows).astype(np.int32)
    slots = rng.choice(nb * bs, rows, replace=False).astype(np.int32)
    inv = _inv_freq(d)
    cache = _cache_setup(nb, L, bs, kvh, d)
    g_cache, g_q = put(cache, True), put(np.zeros((rows, h, d), np.uint16))
    layer = 1
    layer_off = layer * 2 * bs * kvh * d * 2
    qkv_dev = np.ascontiguousarray(interleave_rope(qkv.T, d).T) if interleaved else qkv
    k.rope_kv_write(
        stream,
        put(qkv_dev).ptr,
        put(pos).ptr,
        put(slots).ptr,
        put(inv).ptr,
        g_q.ptr,
        g_cache.ptr + layer_off,
        rows,
        h,
        kvh,
        bs,
        L * 2 * bs * kvh * d,
        prefetch=(g_cache.ptr, cache.size * 2),
        interleaved=interleaved,
    )  # fmt: skip  (L2 prefetch blocks: no effect on results)
    stream.synchronize()
    ang = pos[:, None].astype(np.float32) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rot(x):
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = qkv.reshape(rows, h + 2 * kvh, d)
    assert rel_err(get(g_q, True, (rows, h, d)), rot(x[:, :h])) < 8e-3
    got = get(g_cache, True, cache.shape)
    blk, off = slots // bs, slots % bs
    assert rel_err(got[blk, layer, 0, off], rot(x[:, h : h + kvh])) < 8e-3
    assert rel_err(got[blk, layer, 1, off], x[:, h + kvh :]) < 8e-3
    mask = np.ones(cache.shape[:4], bool)
    mask[blk, layer, :, off] = False
    np.testing.assert_array_equal(got[mask], cache[mask])


def _ref_attention(q, keys, vals, qpos, scale):
    """q [n, h, d]; keys/vals [t, kvh, d]; query i sees keys <= qpos[i]."""
    n, h, d = q.shape
    g = h // keys.shape[1]
    kk = np.repeat(keys, g, axis=1).astype(np.float64)
    vv = np.repeat(vals, g, axis=1).astype(np.float64)
    s = np.einsum("nhd,thd->hnt", q.astype(np.float64), kk) * scale
    s = np.where(np.arange(keys.shape[0])[None, None, :] <= qpos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", p, vv)


@pytest.mark.parametrize("d,g", [(64, 4), (128, 1), (128, 7), (256, 2)])
def test_decode_attention(kern, stream, d, g):
    from engine.cu.kernels import DECODE_SPLITS

    k = kern[(d, g)]
    kvh, bs, L = 2, 16, 2
    h = kvh * g
    ctxs = [1, 37, 700, 3000, 9000][: 5 if d == 128 else 4]
    m = len(ctxs)
    need = [-(-c // bs) for c in ctxs]
    nb = sum(need) + 3
    perm = rng.permutation(nb)
    tables, o = [], 0
    for n in need:
        tables.append(perm[o : o + n])
        o += n
    stride = max(need)
    bt = np.zeros((m, stride), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    cache = _cache_setup(nb, L, bs, kvh, d)
    q = bf(rng.standard_normal((m, h, d)).astype(np.float32))
    pos = np.array([c - 1 for c in ctxs], np.int32)
    layer = 1
    g_cache = put(cache, True)
    g_out = put(np.zeros((m, h * d), np.uint16))
    o_part = put(np.zeros(m * h * DECODE_SPLITS * d, np.float32))
    ml = put(np.zeros(m * h * DECODE_SPLITS * 2, np.float32))
    k.decode_attention(stream, put(q, True).ptr, put(pos).ptr, put(bt).ptr, stride,
                       g_cache.ptr + layer * 2 * bs * kvh * d * 2, L * 2 * bs * kvh * d, bs, kvh, o_part.ptr, ml.ptr,
                       g_out.ptr, m)  # fmt: skip
    stream.synchronize()
    got = get(g_out, True, (m, h, d))
    # The splits are merged in-kernel by the last block of each (lane, KV head); its counters reset,
    # so a second call gives bitwise the same output.
    g_out2 = put(np.zeros((m, h * d), np.uint16))
    k.decode_attention(stream, put(q, True).ptr, put(pos).ptr, put(bt).ptr, stride,
                       g_cache.ptr + layer * 2 * bs * kvh * d * 2, L * 2 * bs * kvh * d, bs, kvh, o_part.ptr, ml.ptr,
                       g_out2.ptr, m)  # fmt: skip
    stream.synchronize()
    np.testing.assert_array_equal(get(g_out2, True, (m, h, d)), got)
    for i, c in enumerate(ctxs):
        t = np.arange(c)
        blk, off = np.asarray(tables[i])[t // bs], t % bs
        ref = _ref_attention(
            q[i : i + 1], cache[blk, layer, 0, off], cache[blk, layer, 1, off], pos[i : i + 1], d**-0.5
        )
        assert rel_err(got[i], ref[0]) < 1e-2, f"lane {i} ctx {c}"


@pytest.mark.parametrize("d,g", [(64, 4), (128, 1), (128, 7), (256, 2)])
def test_decode_attention_verify_rows(kern, stream, d, g):
    """A speculative round's rows: lanes of k + 1 consecutive positions on one block table (8 lanes x
    5 rows, then one lane of 9 and 1-row lanes, 64 rows in all). Each row sees the keys up to its own
    position (the causal rule among a lane's rows) against numpy, and its output is bitwise the one
    it gets in a round of its own."""
    from engine.cu.kernels import DECODE_SPLITS

    k = kern[(d, g)]
    kvh, bs, L, layer = 2, 16, 2, 1
    h = kvh * g
    lanes = [(int(c), 5) for c in rng.integers(1, 2500, 8)] + [(600, 9)] + [(int(c), 1) for c in (1, 40, 3000)]
    lanes += [(int(c), 1) for c in rng.integers(1, 900, 64 - sum(r for _, r in lanes))]
    need = [-(-(c + r) // bs) for c, r in lanes]
    nb = sum(need) + 2
    perm, o, tables = rng.permutation(nb), 0, []
    for n in need:
        tables.append(perm[o : o + n])
        o += n
    stride = max(need)
    rows = [(i, c - 1 + j) for i, (c, r) in enumerate(lanes) for j in range(r)]  # (lane, position)
    m = len(rows)
    assert m == 64
    bt = np.zeros((m, stride), np.int32)
    for row, (i, _) in enumerate(rows):
        bt[row, : len(tables[i])] = tables[i]
    pos = np.array([p for _, p in rows], np.int32)
    cache = _cache_setup(nb, L, bs, kvh, d)
    q = bf(rng.standard_normal((m, h, d)).astype(np.float32))
    g_cache, g_q, g_pos, g_bt = put(cache, True), put(q, True), put(pos), put(bt)
    o_part = put(np.zeros(m * h * DECODE_SPLITS * d, np.float32))
    ml = put(np.zeros(m * h * DECODE_SPLITS * 2, np.float32))
    base, lstride = g_cache.ptr + layer * 2 * bs * kvh * d * 2, L * 2 * bs * kvh * d

    def run(first: int, n: int):
        g_out = put(np.zeros((n, h * d), np.uint16))
        k.decode_attention(stream, g_q.ptr + first * h * d * 2, g_pos.ptr + 4 * first, g_bt.ptr + 4 * first * stride,
                           stride, base, lstride, bs, kvh, o_part.ptr, ml.ptr, g_out.ptr, n)  # fmt: skip
        stream.synchronize()
        return get(g_out, True, (n, h, d))

    got = run(0, m)
    for row, (i, p) in enumerate(rows):
        t = np.arange(p + 1)
        blk, off = np.asarray(tables[i])[t // bs], t % bs
        ref = _ref_attention(q[row : row + 1], cache[blk, layer, 0, off], cache[blk, layer, 1, off], pos[row : row + 1],
                             d**-0.5)  # fmt: skip
        assert rel_err(got[row], ref[0]) < 1e-2, f"row {row} lane {i} position {p}"
    for row in (0, 4, 39, 40, 48, 63):
        np.testing.assert_array_equal(run(row, 1)[0], got[row])


@pytest.mark.parametrize("d,g", [(64, 4), (128, 1), (128, 7), (256, 2)])
@pytest.mark.parametrize("n,start", [(1, 0), (70, 0), (200, 333), (130, 4000)])
def test_prefill_attention(kern, stream, d, g, n, start):
    k = kern[(d, g)]
    kvh, bs, L = 2, 16, 2
    h = kvh * g
    end = start + n
    nblk = -(-end // bs)
    nb = nblk + 5
    table = rng.permutation(nb)[:nblk].astype(np.int32)
    cache = _cache_setup(nb, L, bs, kvh, d)
    q = bf(rng.standard_normal((n, h, d)).astype(np.float32))
    layer = 0
    g_out = put(np.zeros((n, h * d), np.uint16))
    k.prefill_attention(stream, put(q, True).ptr, put(table).ptr, put(cache, True).ptr, L * 2 * bs * kvh * d, bs,
                        kvh, n, start, g_out.ptr)  # fmt: skip
    stream.synchronize()
    t = np.arange(end)
    blk, off = table[t // bs], t % bs
    ref = _ref_attention(q, cache[blk, layer, 0, off], cache[blk, layer, 1, off], np.arange(start, end), d**-0.5)
    assert rel_err(get(g_out, True, (n, h, d)), ref) < 1.5e-2


def test_penalties_and_sampling(kern, stream):
    from engine import sampler
    from engine.backend import SampleRequest
    from engine.backends.cuda.sampling import penalty_list
    from engine.sampling import SamplingParams

    k = kern[(128, 4)]
    vocab = 5000
    cases = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05, top_k=200, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, frequency_penalty=0.7),
        # Below engine.sampling.MIN_TEMPERATURE: greedy on both (1e-40 reaches the kernel as a subnormal).
        SamplingParams(temperature=1e-40, top_p=0.5),
        SamplingParams(temperature=1e-50, top_p=0.9),
        SamplingParams(temperature=1e-7, min_p=0.1),
    ]
    agree = total = 0
    for _trial in range(6):
        m = len(cases)
        logits = (rng.standard_normal((m, vocab)) * 3).astype(np.float32)
        reqs, positions = [], []
        stride = 64
        pen_tok = np.zeros((m, stride), np.int32)
        pen_cnt = np.zeros((m, stride), np.int32)
        pen_num = np.zeros(m, np.int32)
        params = np.zeros((m, 8), np.float32)
        seeds = np.zeros(m, np.uint64)
        for i, p in enumerate(cases):
            req = SampleRequest(params=p, seed=int(rng.integers(0, 2**63)),
                                prompt_token_ids=rng.integers(0, vocab, 20).tolist(),
                                output_token_ids=rng.integers(0, vocab, 15).tolist())  # fmt: skip
            reqs.append(req)
            positions.append(int(rng.integers(1, 100000)))
            ids, cnt = penalty_list(req, vocab)
            pen_num[i] = len(ids)
            pen_tok[i, : len(ids)], pen_cnt[i, : len(ids)] = ids, cnt
            params[i] = (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                         p.repetition_penalty, 0)  # fmt: skip
            seeds[i] = req.seed
        g_l, g_p = put(logits), put(params)
        g_out = put(np.full(m, -1, np.int32))
        k.penalties(stream, g_l.ptr, vocab, g_p.ptr, put(pen_tok).ptr, put(pen_cnt).ptr, put(pen_num).ptr, stride, m)
        k.sample(stream, g_l.ptr, vocab, g_p.ptr, put(seeds).ptr, put(np.array(positions, np.int32)).ptr,
                 g_out.ptr, m)  # fmt: skip
        stream.synchronize()
        penalised = get(g_l)
        toks = get(g_out)
        for i, req in enumerate(reqs):
            x = logits[i].copy()
            sampler.apply_penalties(x, req.params, req.prompt_token_ids, req.output_token_ids)
            np.testing.assert_allclose(penalised[i], x, rtol=1e-6, atol=1e-6)
            ref, _ = sampler.sample_row(logits[i], req, positions[i])
            if req.params.is_greedy:
                assert toks[i] == ref
            total += 1
            agree += int(toks[i] == ref)
            # The token must be one the filters keep.
            if not req.params.is_greedy:
                assert np.isfinite(sampler.process_logits(x, req.params)[toks[i]])
    assert agree >= 0.9 * total, f"{agree}/{total} draws agree with engine.sampler"


# --- the operations of the newer architectures (engine.models.ops), against engine/backends/numpy/ops.py ----


def _np_ops():
    from engine.backends.numpy import ops

    return ops


@pytest.mark.parametrize("rows,inter,k_", [(1, 1408, 512), (5, 64, 200), (12, 1536, 576)])
def test_gate_up_geglu(kern, stream, rows, inter, k_):
    """GeGLU (gelu_tanh(gate) * up): the GEMV epilogue (rows <= 8) and GEMM + swiglu(act) (wider)."""
    from engine.backends.cuda.weights import interleave_gate_up

    k = kern[(128, 4)]
    x = bf(rng.standard_normal((rows, k_)).astype(np.float32))
    gate = bf((rng.standard_normal((inter, k_)) / np.sqrt(k_)).astype(np.float32))
    up = bf((rng.standard_normal((inter, k_)) / np.sqrt(k_)).astype(np.float32))
    ref = _np_ops().gelu_tanh_gate(np.concatenate([x @ gate.T, x @ up.T], 1), inter)
    g_act = put(np.full((rows, inter), 0x7FC0, np.uint16))
    g_gu = put(np.full((rows, 2 * inter), np.nan, np.float32))
    k.gate_up_act(stream, put(x, True).ptr, put(interleave_gate_up(gate, up), True).ptr, g_gu.ptr, g_act.ptr, rows,
                  inter, k_, fn="gelu_tanh")  # fmt: skip
    stream.synchronize()
    assert rel_err(get(g_act, True, (rows, inter)), ref) < 8e-3


@pytest.mark.parametrize("rows,hid", [(1, 576), (7, 1024), (300, 256)])
def test_add_rmsnorm_softcap_and_embed_scale(kern, stream, rows, hid):
    """Post-norm residual add (x += rmsnorm(y) * w, and the next norm's inputs), the logit
    soft-cap, and the scaled embedding gather."""
    ops = _np_ops()
    k = kern[(128, 4)]
    x = rng.standard_normal((rows, hid)).astype(np.float32)
    y = (rng.standard_normal((rows, hid)) * 5).astype(np.float32)
    w, nw = (bf((1 + 0.3 * rng.standard_normal(hid)).astype(np.float32)) for _ in range(2))
    g_x, g_xw = put(x.copy()), put(np.full((rows, hid), 0x7FC0, np.uint16))
    g_ss = put(np.full(rows, np.nan, np.float32))
    assert k.add_rmsnorm(stream, put(y).ptr, put(w, True).ptr, g_x.ptr, rows, hid, 1e-6,
                         norm_out=(put(nw, True).ptr, g_xw.ptr, g_ss.ptr)) == 1  # fmt: skip
    stream.synchronize()
    h = x + ops.rms_norm(y, w, 1e-6)
    got = get(g_x, shape=(rows, hid))
    assert rel_err(got, h) < 1e-5
    np.testing.assert_array_equal(get(g_xw, True, (rows, hid)), bf(got * nw))
    np.testing.assert_allclose(get(g_ss), (got.astype(np.float64) ** 2).sum(-1), rtol=1e-5)
    logits = (rng.standard_normal((rows, hid)) * 40).astype(np.float32)
    g_l = put(logits)
    k.softcap(stream, g_l.ptr, logits.size, 30.0)
    stream.synchronize()
    np.testing.assert_allclose(get(g_l, shape=logits.shape), ops.tanh_softcap(logits, 30.0), rtol=2e-6, atol=2e-5)
    table = bf(rng.standard_normal((50, hid)).astype(np.float32))
    tok = rng.integers(0, 50, rows).astype(np.int32)
    g_e = put(np.full((rows, hid), np.nan, np.float32))
    k.embed(stream, put(tok).ptr, put(table, True).ptr, g_e.ptr, rows, hid, scale=np.sqrt(hid))
    stream.synchronize()
    np.testing.assert_array_equal(get(g_e, shape=(rows, hid)), table[tok] * np.float32(np.sqrt(hid)))


def _np_rope(x, pos, inv, factor, rd):
    ops = _np_ops()
    cos, sin = ops.rope_cos_sin(pos, inv, factor)
    return ops.rope_neox(x, cos, sin)


@pytest.mark.parametrize(
    "d,g,rd,qk", [(64, 4, 32, True), (128, 1, 128, True), (128, 7, 96, False), (64, 1, 0, True), (256, 2, 256, True)]
)
def test_rope_kv_write_qk_norm_partial_rotary(kern, stream, d, g, rd, qk):
    """rope_kv_write on the interleaved order with QKNorm (per-head RMSNorm of q and k), partial rotary
    (only the first rd dims rotate; 0: none) and an attention factor on cos / sin."""
    from engine.backends.cuda.weights import interleave_rope

    ops, k = _np_ops(), kern[(d, g)]
    kvh, rows, bs, L, nb, eps, factor = 2, 6, 16, 3, 20, 1e-6, 1.3
    h = kvh * g
    qkv = (rng.standard_normal((rows, (h + 2 * kvh) * d)) * 3).astype(np.float32)
    pos = rng.integers(0, 5000, rows).astype(np.int32)
    slots = rng.choice(nb * bs, rows, replace=False).astype(np.int32)
    inv = _inv_freq(rd) if rd else np.zeros(1, np.float32)
    qn, kn = (bf((1 + 0.3 * rng.standard_normal(d)).astype(np.float32)) for _ in range(2))
    cache = _cache_setup(nb, L, bs, kvh, d)
    g_cache, g_q = put(cache, True), put(np.zeros((rows, h, d), np.uint16))
    layer = 1
    qkv_dev = np.ascontiguousarray(interleave_rope(qkv.T, d, rd).T)
    k.rope_kv_write(stream, put(qkv_dev).ptr, put(pos).ptr, put(slots).ptr, put(inv).ptr, g_q.ptr,
                    g_cache.ptr + layer * 2 * bs * kvh * d * 2, rows, h, kvh, bs, L * 2 * bs * kvh * d,
                    interleaved=True, rotary_dim=rd, factor=factor,
                    qk_norm=(put(qn, True).ptr, put(kn, True).ptr) if qk else (0, 0), eps=eps)  # fmt: skip
    stream.synchronize()
    x = qkv.reshape(rows, h + 2 * kvh, d)
    q, kk = x[:, :h], x[:, h : h + kvh]
    if qk:
        q, kk = ops.rms_norm(q, qn, eps), ops.rms_norm(kk, kn, eps)
    if rd:
        q, kk = _np_rope(q, pos, inv, factor, rd), _np_rope(kk, pos, inv, factor, rd)
    assert rel_err(get(g_q, True, (rows, h, d)), q) < 8e-3
    got = get(g_cache, True, cache.shape)
    blk, off = slots // bs, slots % bs
    assert rel_err(got[blk, layer, 0, off], kk) < 8e-3
    assert rel_err(got[blk, layer, 1, off], x[:, h + kvh :]) < 8e-3


@pytest.mark.parametrize("d,g,rd", [(64, 4, 32), (128, 4, 96), (128, 4, 0), (256, 2, 256)])
def test_qkv_rope_partial_rotary_and_factor(kern, stream, d, g, rd):
    """The decode q|k|v GEMV's rope epilogue with partial rotary and an attention factor; row 0 the same
    at widths 1 and 5."""
    from engine.backends.cuda.weights import interleave_rope

    k = kern[(d, g)]
    kvh, bs, L, nb, hid, factor = 2, 16, 2, 12, 256, 0.8
    h = g * kvh
    n = (h + 2 * kvh) * d
    x = bf(rng.standard_normal((5, hid)).astype(np.float32))
    w = bf((rng.standard_normal((n, hid)) / np.sqrt(hid)).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32)
    pos = rng.integers(0, 3000, 5).astype(np.int32)
    slots = rng.choice(nb * bs, 5, replace=False).astype(np.int32)
    inv = _inv_freq(rd) if rd else np.zeros(1, np.float32)
    g_w, g_b, g_x = put(interleave_rope(w, d, rd), True), put(interleave_rope(b, d, rd)), put(x, True)
    qs = {}
    for rows in (1, 5):
        cache = _cache_setup(nb, L, bs, kvh, d)
        g_cache, g_q = put(cache, True), put(np.full((rows, h, d), 0x7FC0, np.uint16))
        k.qkv_rope(stream, g_x.ptr, g_w.ptr, g_b.ptr, g_q.ptr, rows, h, kvh, hid, put(pos).ptr, put(slots).ptr,
                   put(inv).ptr, g_cache.ptr, bs, L * 2 * bs * kvh * d, rotary_dim=rd, factor=factor)  # fmt: skip
        stream.synchronize()
        qkv = (x[:rows] @ w.T + b).reshape(rows, h + 2 * kvh, d)
        q, kk = qkv[:, :h], qkv[:, h : h + kvh]
        if rd:
            q, kk = _np_rope(q, pos[:rows], inv, factor, rd), _np_rope(kk, pos[:rows], inv, factor, rd)
        qs[rows] = get(g_q, True, (rows, h, d))
        assert rel_err(qs[rows], q) < 8e-3
        got = get(g_cache, True, cache.shape)
        blk, off = slots[:rows] // bs, slots[:rows] % bs
        assert rel_err(got[blk, 0, 0, off], kk) < 8e-3
        assert rel_err(got[blk, 0, 1, off], qkv[:, h + kvh :]) < 8e-3
    np.testing.assert_array_equal(qs[1][0], qs[5][0])


def _np_paged(q, cache, layer, tables, q_pos, ctxs, kvh, window, scale, softcap, sinks):
    """engine/backends/numpy's paged_attention per sequence: q [n, T, h, d], tables of block ids."""
    ops = _np_ops()
    nb, _, _, bs, _, d = cache.shape
    k_rows = cache[:, layer, 0].reshape(nb * bs, kvh * d)
    v_rows = cache[:, layer, 1].reshape(nb * bs, kvh * d)
    outs = []
    for i, c in enumerate(ctxs):
        t = np.arange(c)
        ctx_slots = (np.asarray(tables[i])[t // bs] * bs + t % bs)[None]
        mask = ops.attention_mask(np.asarray(q_pos[i])[None], t[None], window)
        outs.append(ops.paged_attention(q[i], k_rows, v_rows, ctx_slots, mask, kvh, scale=scale, softcap=softcap,
                                        sinks=sinks))  # fmt: skip
    return outs


OPTIONS = [  # (window, scale, softcap, sinks)
    (None, 0.1, 50.0, False),
    (100, None, None, True),
    (40, 0.08, 20.0, True),
    (1, None, None, False),
]


@pytest.mark.parametrize("window,scale,softcap,sinks", OPTIONS)
@pytest.mark.parametrize("d,g", [(64, 4), (128, 7), (256, 2)])
def test_decode_attention_options(kern, stream, d, g, window, scale, softcap, sinks):
    """Scale, soft-cap, sliding window and sinks in decode attention against numpy. Block-table entries
    wholly behind the window point at a block of NaNs: reading any of them would poison the output."""
    from engine.cu.kernels import DECODE_SPLITS, AttnArgs, attention_scales

    k = kern[(d, g)]
    kvh, bs, L = 2, 16, 2
    h = kvh * g
    ctxs = [1, 37, 700, 3000]
    need = [-(-c // bs) for c in ctxs]
    nb = sum(need) + 1
    poison = nb - 1
    perm = rng.permutation(nb - 1)
    tables, o = [], 0
    for n in need:
        tables.append(perm[o : o + n])
        o += n
    m, stride = len(ctxs), max(need)
    bt = np.zeros((m, stride), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
        if window:
            bt[i, : max(0, ctxs[i] - window) // bs] = poison
    cache = _cache_setup(nb, L, bs, kvh, d)
    cache[poison] = np.nan
    sink = (rng.standard_normal(h) * 2).astype(np.float32) if sinks else None
    q = bf(rng.standard_normal((m, h, d)).astype(np.float32))
    pos = np.array([c - 1 for c in ctxs], np.int32)
    s_l2, c_l2 = attention_scales(d, scale, softcap)
    args = AttnArgs(s_l2, c_l2, window or 0, put(sink).ptr if sinks else 0)
    layer = 1
    g_out = put(np.zeros((m, h * d), np.uint16))
    o_part = put(np.zeros(m * h * DECODE_SPLITS * d, np.float32))
    ml = put(np.zeros(m * h * DECODE_SPLITS * 2, np.float32))
    k.decode_attention(stream, put(q, True).ptr, put(pos).ptr, put(bt).ptr, stride,
                       put(cache, True).ptr + layer * 2 * bs * kvh * d * 2, L * 2 * bs * kvh * d, bs, kvh, o_part.ptr,
                       ml.ptr, g_out.ptr, m, args=args)  # fmt: skip
    stream.synchronize()
    got = get(g_out, True, (m, h, d))
    assert np.isfinite(got).all()
    ref = _np_paged(q[:, None], cache, layer, tables, pos[:, None], ctxs, kvh, window, scale, softcap, sink)
    for i, c in enumerate(ctxs):
        assert rel_err(got[i], ref[i].reshape(h, d)) < 1e-2, f"lane {i} ctx {c}"


@pytest.mark.parametrize("window,scale,softcap,sinks", OPTIONS)
@pytest.mark.parametrize("n,start", [(70, 0), (200, 333)])
@pytest.mark.parametrize("d,g", [(64, 4), (256, 2)])
def test_prefill_attention_options(kern, stream, d, g, n, start, window, scale, softcap, sinks):
    """The same options in prefill attention (over a retained prefix), poisoned blocks behind the
    window of the chunk's first query."""
    from engine.cu.kernels import AttnArgs, attention_scales

    k = kern[(d, g)]
    kvh, bs, L = 2, 16, 2
    h = kvh * g
    end = start + n
    nblk = -(-end // bs)
    nb = nblk + 2
    poison = nb - 1
    table = rng.permutation(nb - 1)[:nblk].astype(np.int32)
    dev_table = table.copy()
    if window:
        dev_table[: max(0, start - window + 1) // bs] = poison
    cache = _cache_setup(nb, L, bs, kvh, d)
    cache[poison] = np.nan
    sink = (rng.standard_normal(h) * 2).astype(np.float32) if sinks else None
    q = bf(rng.standard_normal((n, h, d)).astype(np.float32))
    s_l2, c_l2 = attention_scales(d, scale, softcap)
    args = AttnArgs(s_l2, c_l2, window or 0, put(sink).ptr if sinks else 0)
    g_out = put(np.zeros((n, h * d), np.uint16))
    k.prefill_attention(stream, put(q, True).ptr, put(dev_table).ptr, put(cache, True).ptr, L * 2 * bs * kvh * d, bs,
                        kvh, n, start, g_out.ptr, args=args)  # fmt: skip
    stream.synchronize()
    got = get(g_out, True, (n, h, d))
    assert np.isfinite(got).all()
    ref = _np_paged(q[None], cache, 0, [table], [np.arange(start, end)], [end], kvh, window, scale, softcap, sink)
    assert rel_err(got, ref[0].reshape(n, h, d)) < 1.5e-2
