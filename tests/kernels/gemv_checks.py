"""Checks shared by the quantized GEMV tests (test_cuda_quant.py's GGUF blocks, test_cuda_fp8.py's fp8):
every linear epilogue over a weight matrix already on the device, against numpy in float64."""

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
