"""The quantized GEMV launched persistent (``Kernels(quant_persist=True)``: at most the resident
blocks, each walking 16-row tiles with its stage pipeline running on between them) gives every
output the bits of a block a tile: every format, store (with the next norm's xw and ss partials),
acc, SwiGLU and rope, bf16 and int8 activations, widths 1..8, on matrices of more tiles than
blocks fit the card at once. Skipped without a card."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda
from tests.kernels.test_cuda_quant import FORMATS, k_for, random_blocks

pytestmark = requires_cuda
rng = np.random.default_rng(11)


@pytest.fixture(scope="module")
def kerns():
    from engine.cu import runtime
    from engine.cu.kernels import Kernels
    from engine.cu.quant import quant_act_bytes

    with runtime.current():
        import pycuda.driver as cuda

        out = {}
        for act8 in (False, True):
            for persist in (False, True):
                k = Kernels(128, 4, formats=FORMATS, quant_act=act8, quant_persist=persist)
                if act8:
                    buf = cuda.mem_alloc(quant_act_bytes(4096))
                    k.qact, k.qact_bytes, k._buf = int(buf), quant_act_bytes(4096), buf
                out[(act8, persist)] = k
        yield cuda, out


def _put(cuda, a):
    g = cuda.mem_alloc(max(a.nbytes, 16))
    cuda.memcpy_htod(g, np.ascontiguousarray(a))
    return g


@pytest.mark.parametrize("act8", [False, True], ids=["bf16-x", "int8-x"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_persistent_launches_give_the_same_bits(kerns, fmt, act8):
    from engine.backends.cuda.weights import to_bf16
    from engine.cu.quant import Matrix, Part

    cuda, ks = kerns
    k = k_for(fmt)
    n = 16 * (ks[(act8, True)].quant(fmt).resident + 37)  # more tiles than resident blocks, a ragged share
    blocks = random_blocks(fmt, n, k, gen=rng)
    live = [_put(cuda, blocks)]
    mat = Matrix((Part(int(live[0]), fmt, n),), k)
    s = cuda.Stream()
    for rows in (1, 3, 8):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        g_x = _put(cuda, to_bf16(x))
        nw = _put(cuda, to_bf16(1 + 0.3 * rng.standard_normal(n).astype(np.float32)))
        ss = _put(cuda, (rng.random((rows, 2)) * k).astype(np.float32))
        live += [g_x, nw, ss]
        got = []
        for persist in (False, True):
            kern = ks[(act8, persist)]
            o1 = _put(cuda, np.full((rows, n), np.nan, np.float32))
            xw = _put(cuda, np.full((rows, n), 0x7FC0, np.uint16))
            so = _put(cuda, np.full(rows * (n // 16), np.nan, np.float32))
            act = _put(cuda, np.full((rows, n // 2), 0x7FC0, np.uint16))
            live += [o1, xw, so, act]
            kern.linear(s, int(g_x), mat, 0, int(o1), rows, n, k, ss_in=(int(ss), 2), eps=1e-5,
                        norm_out=(int(nw), int(xw), int(so)))  # fmt: skip
            kern.gate_up_act(s, int(g_x), mat, 0, int(act), rows, n // 2, k)
            s.synchronize()
            outs = []
            for g, shape, dt in ((o1, (rows, n), np.float32), (xw, (rows, n), np.uint16),
                                 (so, (rows * (n // 16),), np.float32), (act, (rows, n // 2), np.uint16)):  # fmt: skip
                h = np.empty(shape, dt)
                cuda.memcpy_dtoh(h, g)
                outs.append(h)
            got.append(outs)
        for name, a, b in zip(("store", "xw", "ss_out", "swiglu"), *got):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"{name}, {rows} rows")
        assert np.isfinite(got[0][0]).all()
