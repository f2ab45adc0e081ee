"""prefill_attn_hopper (engine/cu/attention_prefill_hopper.cu, engine/cu/hopper.py) against the numpy
reference on random inputs: group sizes 1..8, pages of 8..256 rows, chunks of 1..1,000 positions after
retained prefixes of 0..4,000 (every chunk boundary against the 128-key tiles and the blocks of
positions), the other compiled variants (P V width, stages, ping-pong) on a few; through ``Kernels.prefill_attention`` (the routing); and against
torch's attention on a long grouped chunk of the 8B shape. Skipped without PyCUDA and a Hopper
(sm_90) device; which calls it covers is checked without one."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cu import hopper
from tests.kernels.gpu import cuda_available, gpu

rng = np.random.default_rng()


def test_covers():
    assert hopper.attention_covers(128, 4, 16) and hopper.attention_covers(128, 8, 256)
    assert hopper.attention_covers(128, 1, 8) and hopper.attention_covers(128, 2, 128)
    assert not hopper.attention_covers(64, 4, 16)  # head_dim 64 / 256: attention_prefill.cu
    assert not hopper.attention_covers(128, 7, 16)  # 7 does not divide the block's 128 rows
    assert not hopper.attention_covers(128, 4, 4)  # pages under 8 rows
    assert not hopper.attention_covers(128, 4, 48)  # pages that do not tile the 128-key tiles


def _hopper() -> bool:
    if not cuda_available():
        return False
    from engine.cu import runtime

    with runtime.current():
        return hopper.supported()


@pytest.fixture(scope="module")
def dev():
    if not _hopper():
        pytest.skip("needs an sm_90 (Hopper) device")
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


@pytest.fixture(scope="module")
def fa(dev):
    return {g: hopper.HopperAttention(g) for g in (1, 2, 4, 8)}


def bf(a):
    from engine.backends.cuda.weights import from_bf16, to_bf16

    return from_bf16(to_bf16(a)).reshape(np.shape(a))


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) + 1e-30))


def reference(q, keys, vals, start):
    """q [n, h, d] at positions start..; keys/vals [t, kvh, d]; position p sees keys 0..p."""
    n, h, d = q.shape
    g = h // keys.shape[1]
    kk = np.repeat(keys, g, axis=1).astype(np.float64)
    vv = np.repeat(vals, g, axis=1).astype(np.float64)
    s = np.einsum("nhd,thd->hnt", q.astype(np.float64), kk) * d**-0.5
    pos = np.arange(start, start + n)
    s = np.where(np.arange(keys.shape[0])[None, None, :] <= pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", p, vv)


def run(dev, stream, call, g, kvh, bs, n, start, L=2, layer=1, pad=3):
    """One call on fresh random inputs (a shuffled block table, spare pages); returns (got, ref) and checks
    that the ``pad`` rows past n were not written."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import from_bf16, to_bf16

    d, h, end = 128, kvh * g, start + n
    nblk = -(-end // bs)
    nb = nblk + 4
    table = rng.permutation(nb)[:nblk].astype(np.int32)
    cache = bf(rng.standard_normal((nb, L, 2, bs, kvh, d)).astype(np.float32))
    q = bf(rng.standard_normal((n, h, d)).astype(np.float32))
    sentinel = np.full(((n + pad) * h * d,), 0x7FC1, np.uint16)
    g_q, g_t, g_c, g_o = ga.to_gpu(to_bf16(q)), ga.to_gpu(table), ga.to_gpu(to_bf16(cache)), ga.to_gpu(sentinel)
    block_stride = L * 2 * bs * kvh * d
    call(stream, g_q.ptr, g_t.ptr, g_c.ptr + layer * 2 * bs * kvh * d * 2, block_stride, bs, kvh, n, start, g_o.ptr)
    stream.synchronize()
    raw = g_o.get()
    assert (raw[n * h * d :] == 0x7FC1).all(), "rows past n were written"
    got = from_bf16(raw[: n * h * d]).reshape(n, h, d)
    t = np.arange(end)
    blk, off = table[t // bs], t % bs
    return got, reference(q, cache[blk, layer, 0, off], cache[blk, layer, 1, off], start)


CASES = [  # (group, KV heads, block_size, n, start)
    (4, 2, 16, 1, 0), (4, 2, 16, 70, 0), (4, 2, 16, 300, 333), (1, 2, 16, 130, 4000), (2, 3, 32, 257, 100),
    (8, 1, 8, 129, 7), (4, 2, 128, 200, 250), (4, 1, 256, 400, 0), (8, 2, 64, 1000, 1500), (1, 1, 16, 33, 127),
    (2, 2, 16, 64, 128), (4, 2, 16, 31, 97),
]  # fmt: skip


def check(dev, stream, k, g, kvh, bs, n, start):
    scale_log2 = 128**-0.5 * np.log2(np.e)

    def call(s, q, t, c, stride, bs_, kvh_, n_, start_, out):
        k(s, q, t, c, stride, bs_, kvh_, n_, start_, out, scale_log2)

    got, ref = run(dev, stream, call, g, kvh, bs, n, start)
    assert np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err < 1.5e-2, f"g={g} kvh={kvh} bs={bs} n={n} start={start}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("g,kvh,bs,n,start", CASES)
def test_matches_numpy(dev, stream, fa, g, kvh, bs, n, start):
    check(dev, stream, fa[g], g, kvh, bs, n, start)


@gpu
@pytest.mark.parametrize("variant", hopper.FA_VARIANTS[1:])
@pytest.mark.parametrize("g", [4, 8])
def test_other_variants(dev, stream, variant, g):
    k = hopper.HopperAttention(g, variant=variant)
    for kvh, bs, n, start in [(2, 16, 300, 333), (1, 64, 1000, 1500), (2, 16, 31, 97)]:
        check(dev, stream, k, g, kvh, bs, n, start)


@gpu
@pytest.mark.parametrize("g,bs", [(4, 16), (1, 32)])
def test_kernels_routes_to_hopper(dev, stream, g, bs):
    """``Kernels.prefill_attention`` runs prefill_attn_hopper for plain attention at head_dim 128 on this device."""
    from engine.cu.kernels import Kernels

    k = Kernels(128, g)
    assert k._prefill_hopper is not None

    def call(s, q, t, c, stride, bs_, kvh_, n_, start_, out):
        k.prefill_attention(s, q, t, c, stride, bs_, kvh_, n_, start_, out)

    got, ref = run(dev, stream, call, g, 2, bs, 150, 200)
    assert rel_err(got, ref) < 1.5e-2


@gpu
def test_long_chunk_matches_torch(dev, stream, fa):
    """4,096 positions after a 4,096-token prefix, 32 q heads on 8 KV heads: against torch's attention in fp32."""
    torch = pytest.importorskip("torch")
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import from_bf16, to_bf16

    g, kvh, bs, n, start, d = 4, 8, 16, 4096, 4096, 128
    end, h = start + n, kvh * g
    nblk = end // bs
    table = rng.permutation(nblk + 8)[:nblk].astype(np.int32)
    cache = to_bf16(rng.standard_normal((nblk + 8, 1, 2, bs, kvh, d)).astype(np.float32))
    q = to_bf16(rng.standard_normal((n, h, d)).astype(np.float32))
    g_q, g_t, g_c = ga.to_gpu(q), ga.to_gpu(table), ga.to_gpu(cache)
    g_o = ga.to_gpu(np.zeros(n * h * d, np.uint16))
    fa[g](stream, g_q.ptr, g_t.ptr, g_c.ptr, 2 * bs * kvh * d, bs, kvh, n, start, g_o.ptr,
                 d**-0.5 * np.log2(np.e))  # fmt: skip
    stream.synchronize()
    got = torch.from_numpy(from_bf16(g_o.get()).reshape(n, h, d))
    c = torch.from_numpy(from_bf16(cache).reshape(cache.shape)).cuda()
    tb = torch.from_numpy(table).long().cuda()
    keys = c[:, 0, 0][tb].reshape(end, kvh, d).repeat_interleave(g, 1).transpose(0, 1)  # [h, t, d]
    vals = c[:, 0, 1][tb].reshape(end, kvh, d).repeat_interleave(g, 1).transpose(0, 1)
    qq = torch.from_numpy(from_bf16(q).reshape(n, h, d)).cuda().transpose(0, 1)
    mask = torch.arange(end, device="cuda")[None, :] <= torch.arange(start, end, device="cuda")[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask).transpose(0, 1).cpu()
    err = float((got - ref).norm() / ref.norm())
    assert err < 1.5e-2, f"rel err {err:.2e}"


SPANS = [  # (group, KV heads, block_size, [(n, start) of each span])
    (4, 2, 16, [(24, 16), (1, 0), (70, 300), (33, 127), (130, 5)]),
    (8, 1, 8, [(17, 3), (16, 0), (129, 40)]),
    (1, 2, 64, [(200, 1000), (8, 8)]),
]  # fmt: skip


@gpu
@pytest.mark.parametrize("g,kvh,bs,spans", SPANS)
def test_spans_in_one_launch_give_each_span_its_bits(dev, stream, fa, g, kvh, bs, spans):
    """prefill_attn_hopper_spans (a prefill pass's spans in one launch, each with its own rows, positions
    and block table) writes the bits one launch a span writes, and no row past the pass's; through
    ``Kernels.prefill_attention_spans`` too (the staged table's layout, against its one-a-span path)."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import to_bf16
    from engine.cu.kernels import Kernels

    d, h, L, layer, pad = 128, kvh * g, 2, 1, 3
    rows = sum(n for n, _ in spans)
    tables, entries, nb = [], [], 0
    for n, start in spans:  # each span its own pages, shuffled over one pool
        entries.append(sum(len(t) for t in tables))
        tables.append(list(range(nb, nb + -(-(start + n) // bs))))
        nb += len(tables[-1])
    perm = rng.permutation(nb + 4).astype(np.int32)
    flat = np.concatenate([perm[t] for t in tables]).astype(np.int32)
    cache = to_bf16(rng.standard_normal((nb + 4, L, 2, bs, kvh, d)).astype(np.float32))
    q = to_bf16(rng.standard_normal((rows, h, d)).astype(np.float32))
    g_q, g_t, g_c = ga.to_gpu(q), ga.to_gpu(flat), ga.to_gpu(cache)
    c_ptr, stride, row = g_c.ptr + layer * 2 * bs * kvh * d * 2, L * 2 * bs * kvh * d, h * d * 2
    scale_log2 = d**-0.5 * np.log2(np.e)
    r0s = np.cumsum([0] + [n for n, _ in spans])[:-1]
    staged = np.array([(r0, n, start, e) for r0, (n, start), e in zip(r0s, spans, entries)], np.int32)
    g_s = ga.to_gpu(staged.reshape(-1))

    def out():
        return ga.to_gpu(np.full(((rows + pad) * h * d,), 0x7FC1, np.uint16))

    alone, one, routed, looped = out(), out(), out(), out()
    for (n, start), r0, e in zip(spans, r0s, entries):
        fa[g](stream, g_q.ptr + r0 * row, g_t.ptr + 4 * e, c_ptr, stride, bs, kvh, n, start, alone.ptr + r0 * row,
              scale_log2)  # fmt: skip
    fa[g].spans(stream, g_q.ptr, rows, g_s.ptr, [n for n, _ in spans], g_t.ptr, c_ptr, stride, bs, kvh, one.ptr,
                scale_log2)  # fmt: skip
    k = Kernels(128, g)
    layout = [(int(r0), n, g_t.ptr + 4 * e, start) for r0, (n, start), e in zip(r0s, spans, entries)]
    k.prefill_attention_spans(stream, g_q.ptr, rows, layout, g_s.ptr, c_ptr, stride, bs, kvh, routed.ptr)
    k.prefill_attention_spans(stream, g_q.ptr, rows, layout, 0, c_ptr, stride, bs, kvh, looped.ptr)
    stream.synchronize()
    want = alone.get()
    assert (want[rows * h * d :] == 0x7FC1).all() and (want[: rows * h * d] != 0x7FC1).any()
    for got in (one, routed, looped):
        np.testing.assert_array_equal(got.get(), want)
