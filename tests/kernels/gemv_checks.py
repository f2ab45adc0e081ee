"""Checks shared by the quantized GEMV tests (test_cuda_quant.py's GGUF blocks, test_cuda_fp8.py's fp8):
every linear epilogue over a weight matrix already on the device, against numpy in float64; the rope +
KV-write epilogue over a q|k|v of two GGUF formats (test_cuda_quant.py, test_cuda_quant_act.py)."""

from __future__ import annotations

import numpy as np


def ss_parts(h: np.ndarray) -> np.ndarray:
    """A row's sum of squares as two partial sums (what a fused producer writes for ss_in)."""
    ss = (h.astype(np.float64) ** 2).sum(-1)
    return np.stack([ss * 0.5, ss * 0.5], -1).astype(np.float32)


def rms_norm(h, nw, eps):
    return h / np.sqrt((h.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * nw


def check_epilogue(kern, stream, epi: str, mat, w: np.ndarray, rng, label="", product=None, tol=None,
                   widths=(1, 2, 8)) -> None:  # fmt: skip
    """``mat`` ([n, k] on the device, any format) through epilogue ``epi`` at widths 1, 2, 8 against numpy
    on ``w``, its float32 values (for swiglu / geglu: the gate|up rows interleaved in 8-row groups, as
    ``mat``): store with bias and the fused RMSNorm's ss_in, acc with norm_out, swiglu and geglu; a row's
    result is bitwise the same at every width. ``product``: the kernel's x @ w.T as a function of the
    bf16 x rows (float64 [rows, n]; default: that product in float64), for a kernel that does not
    multiply x as given (int8 activations); the swiglu / geglu references then take it too, scaled by
    the rows' norm. ``tol``: the store / acc tolerance (default 2e-4)."""
    from tests.kernels.test_cuda_kernels import bf, get, put, rel_err

    n, k = w.shape
    eps = 1e-5
    hres = (rng.standard_normal((8, k)) * 2).astype(np.float32)
    nw = bf((1 + 0.3 * rng.standard_normal(k)).astype(np.float32))
    x = bf(hres * nw)  # what the producer wrote: bf16(h * norm weight)
    g_x, g_parts = put(x, True), put(ss_parts(hres))
    bias = rng.standard_normal(n).astype(np.float32)
    base = rng.standard_normal((8, n)).astype(np.float32)
    nw2 = bf((1 + 0.3 * rng.standard_normal(n)).astype(np.float32))
    outs = {}
    for rows in widths:
        xn = rms_norm(hres[:rows], nw, eps)
        xw_ = x[:rows].astype(np.float64) @ w.T if product is None else product(x[:rows])
        ltol = 2e-4 if tol is None else tol
        if epi == "store":
            g_o = put(np.full((rows, n), np.nan, np.float32))
            kern.linear(stream, g_x.ptr, mat, put(bias).ptr, g_o.ptr, rows, n, k, ss_in=(g_parts.ptr, 2), eps=eps)
            stream.synchronize()
            # The kernel scales bf16(h * nw) @ w.T by the row's rsqrt(mean(h^2) + eps): so does the reference.
            rs = 1 / np.sqrt((hres[:rows].astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
            got, ref, etol = get(g_o).reshape(rows, n), rs * xw_ + bias, ltol
        elif epi == "acc":
            g_o = put(base[:rows].copy())
            g_xw, g_ss = put(np.zeros((rows, n), np.uint16)), put(np.zeros(rows * (-(-n // 16)), np.float32))
            nparts = kern.linear(stream, g_x.ptr, mat, 0, g_o.ptr, rows, n, k, accumulate=True,
                                 norm_out=(put(nw2, True).ptr, g_xw.ptr, g_ss.ptr))  # fmt: skip
            stream.synchronize()
            got, ref, etol = get(g_o).reshape(rows, n), base[:rows] + xw_, ltol
            np.testing.assert_array_equal(get(g_xw, True, (rows, n)), bf(got * nw2))
            ss = get(g_ss).reshape(rows, nparts).sum(-1)
            np.testing.assert_allclose(ss, (got.astype(np.float64) ** 2).sum(-1), rtol=1e-5)
        else:
            inter = n // 2
            gate, up = w.reshape(-1, 2, 8, k)[:, 0].reshape(-1, k), w.reshape(-1, 2, 8, k)[:, 1].reshape(-1, k)
            g_act = put(np.full((rows, inter), 0x7FC0, np.uint16))
            kern.gate_up_act(stream, g_x.ptr, mat, 0, g_act.ptr, rows, inter, k, ss_in=(g_parts.ptr, 2), eps=eps,
                             fn="silu" if epi == "swiglu" else "gelu_tanh")  # fmt: skip
            stream.synchronize()
            if product is None:
                g, u = xn @ gate.T, xn @ up.T
            else:  # the kernel's product, scaled by the row's norm as the epilogue does
                rs = 1 / np.sqrt((hres[:rows].astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
                gu = (rs * xw_).reshape(rows, -1, 2, 8)
                g, u = gu[:, :, 0].reshape(rows, -1), gu[:, :, 1].reshape(rows, -1)
            a = (
                g / (1 + np.exp(-g))
                if epi == "swiglu"
                else 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3)))
            )
            got, ref, etol = get(g_act, True, (rows, inter)), a * u, 8e-3
        assert rel_err(got, ref) < etol, (label, epi, rows, rel_err(got, ref))
        outs[rows] = got
    wide = max(widths)
    for rows in widths:
        np.testing.assert_array_equal(outs[rows], outs[wide][:rows])


def check_qkv_rope(kern, stream, fmt: str, vfmt: str, k: int, product, tol: float, rng) -> None:
    """The rope + KV-write epilogue over a q|k|v matrix of two parts (q|k rows in ``fmt``, v rows in
    ``vfmt``, each rope-interleaved as the uploader does) at widths 1, 2, 8 against numpy: q and the cache's
    K rotated, its V copied, each within ``tol``; row 0 bitwise the same at every width. ``product(b_qk,
    b_v, hres, nw, eps, rows)``: the kernel's product for the first ``rows`` rows before the bias (float64
    [rows, n_qk + n_v], rope-interleaved columns as the blocks' rows), the one format-specific part. The
    blocks come from random_blocks' own generator, hres, nw, bias, positions and slots from ``rng``."""
    from engine.backends.cuda.weights import interleave_rope
    from engine.cu.quant import Matrix, Part
    from tests.kernels.test_cuda_kernels import _cache_setup, _inv_freq, bf, get, put, rel_err
    from tests.kernels.test_cuda_quant import _uninterleave, random_blocks

    d, kvh, g = 64, 2, 2
    h, bs, L, nb, eps = kvh * g, 16, 2, 12, 1e-6
    qk_rows, v_rows = (h + kvh) * d, kvh * d
    b_qk = interleave_rope(random_blocks(fmt, qk_rows, k, 0.2 / np.sqrt(k)), d)
    b_v = interleave_rope(random_blocks(vfmt, v_rows, k, 0.2 / np.sqrt(k)), d)  # every head, as the uploader
    g_qk, g_v = put(b_qk), put(b_v)
    mat = Matrix((Part(int(g_qk.ptr), fmt, qk_rows), Part(int(g_v.ptr), vfmt, v_rows)), k)
    hres = (rng.standard_normal((8, k)) * 2).astype(np.float32)
    nw = bf((1 + 0.3 * rng.standard_normal(k)).astype(np.float32))
    bias = rng.standard_normal(qk_rows + v_rows).astype(np.float32)
    pos = rng.integers(0, 3000, 8).astype(np.int32)
    slots = rng.choice(nb * bs, 8, replace=False).astype(np.int32)
    inv = _inv_freq(d)
    g_x, g_parts, g_b = put(bf(hres * nw), True), put(ss_parts(hres)), put(bias)
    g_pos, g_slots, g_inv = put(pos), put(slots), put(inv)
    stride = L * 2 * bs * kvh * d
    q0 = {}
    for rows in (1, 2, 8):
        cache = _cache_setup(nb, L, bs, kvh, d)
        g_cache, g_q = put(cache, True), put(np.full((rows, h, d), 0x7FC0, np.uint16))
        kern.qkv_rope(stream, g_x.ptr, mat, g_b.ptr, g_q.ptr, rows, h, kvh, k, g_pos.ptr, g_slots.ptr, g_inv.ptr,
                      g_cache.ptr, bs, stride, ss_in=(g_parts.ptr, 2), eps=eps)  # fmt: skip
        stream.synchronize()
        # Undo the interleave to get natural head order, then rotate as rope_kv_write does.
        y = product(b_qk, b_v, hres, nw, eps, rows) + bias
        y = _uninterleave(y, d, h + 2 * kvh)
        ang = pos[:rows, None].astype(np.float64) * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x3 = y.reshape(rows, h + 2 * kvh, d)

        def rot(z, cos=cos, sin=sin):
            a, b2 = z[..., : d // 2], z[..., d // 2 :]
            return np.concatenate([a * cos - b2 * sin, b2 * cos + a * sin], -1)

        q = get(g_q, True, (rows, h, d))
        assert rel_err(q, rot(x3[:, :h])) < tol
        got = get(g_cache, True, cache.shape)
        blk, off = slots[:rows] // bs, slots[:rows] % bs
        assert rel_err(got[blk, 0, 0, off], rot(x3[:, h : h + kvh])) < tol
        assert rel_err(got[blk, 0, 1, off], x3[:, h + kvh :]) < tol
        q0[rows] = (q[0], got[blk[0], 0, :, off[0]])
    for a, b in zip(q0[1], q0[8]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(q0[2], q0[8]):
        np.testing.assert_array_equal(a, b)
