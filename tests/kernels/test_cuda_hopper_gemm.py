"""gemm_hopper (engine/cu/gemm_hopper.cu, engine/cu/hopper.py) against numpy on small odd shapes
(every tile variant, bias, accumulate, a padded ldc), through ``Kernels.linear``, and against
torch.matmul on the Llama-3.1-8B prefill shapes: skipped without PyCUDA and a Hopper (sm_90)
device. The tile choice and the launch buffer's layout are checked without one."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cu import hopper
from tests.kernels.gpu import cuda_available, gpu

rng = np.random.default_rng()


def test_pick_fills_the_sms():
    """The variant by tile rounds x tile cost on 132 SMs (what bench/bench_gemm.py --variants measured best)."""
    assert hopper.pick(16, 6144, 132) == (1, 128)  # memory-bound: the most blocks
    assert hopper.pick(16, 28672, 132) == (1, 256)  # 448 narrow tiles would take 4 rounds
    assert hopper.pick(128, 28672, 132) == (2, 256)  # 112 tiles, one round
    assert hopper.pick(1024, 6144, 132) == (2, 128)  # 384 tiles in 3 rounds beat 192 wide ones in 2
    assert hopper.pick(2048, 6144, 132) == (2, 256)
    assert hopper.pick(8192, 28672, 132) == (2, 256)


def test_few_rows_take_narrow_tiles_that_stream_w_from_more_sms():
    """With the bf16 build's narrow tiles: for 33..128 rows, a product whose wide tiles leave SMs idle
    goes to tiles as tall as its rows and narrow enough to spread W; a wide one that already fills
    the SMs (gate|up) and every product past 128 rows keep the tile-cost choice."""
    every = hopper.VARIANTS + hopper.NARROW
    assert hopper.pick(48, 4096, 132, every) == (1, 32)  # o, down: 128 blocks, not 32
    assert hopper.pick(48, 6144, 132, every) == (1, 64)  # q,k,v: 96 blocks (192 narrower would take 2 rounds)
    assert hopper.pick(120, 4096, 132, every) == (2, 32)  # 128 rows tall: W streamed once
    assert hopper.pick(48, 28672, 132, every) == (1, 256)  # 112 wide tiles stream 256 rows; narrow 224
    for m, n in ((16, 4096), (32, 6144), (129, 4096), (1024, 6144), (8192, 28672)):
        assert hopper.pick(m, n, 132, every) == hopper.pick(m, n, 132)
    assert hopper.pick(48, 4096, 132) == (1, 128)  # without them (the fp8 builds) as before


def test_pack_format_follows_the_offsets():
    # gemm_hopper's layout on sm_90: the 64-byte aligned tensor maps start at 48 (the bank's base is 0x210)
    layout = [(48, 128), (176, 128), (304, 8), (312, 8), (320, 4), (324, 4), (328, 4), (332, 4), (336, 4), (340, 4)]
    fmt = hopper.pack_format(layout, hopper.PARAMS)
    assert fmt == "48x128s128sPPiiiiii"
    import struct

    buf = struct.pack(fmt, b"a" * 128, b"w" * 128, 5, 6, 1, 2, 3, 4, 0, -1)
    assert buf[48:176] == b"a" * 128 and struct.unpack_from("=Qi", buf, 312) == (6, 1)
    with pytest.raises(ValueError):
        hopper.pack_format([(0, 8)], ["i"])


def _hopper() -> bool:
    if not cuda_available():
        return False
    from engine.cu import hopper, runtime

    with runtime.current():
        return hopper.supported()


@pytest.fixture(scope="module")
def hg():  # the GPU tests' fixture: skips without an sm_90 device
    if not _hopper():
        pytest.skip("needs an sm_90 (Hopper) device")
    from engine.cu import runtime
    from engine.cu.hopper import HopperGemm

    with runtime.current():
        yield HopperGemm()


@pytest.fixture(scope="module")
def stream(hg):
    import pycuda.driver as cuda

    return cuda.Stream()


def bf(a):
    from engine.backends.cuda.weights import from_bf16, to_bf16

    return from_bf16(to_bf16(a)).reshape(np.shape(a))


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) + 1e-30))


def run_numpy(hg, stream, m, n, k, *, bias, accumulate, pad=0, variant=None):
    """One product through gemm_hopper on fresh random inputs; returns (got, reference) over the
    first n columns, and checks that the ``pad`` columns past n (ldc = n + pad) are untouched."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import to_bf16

    a = bf(rng.standard_normal((m, k)).astype(np.float32))
    w = bf((rng.standard_normal((n, k)) * k**-0.5).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    ldc = n + pad
    c0 = rng.standard_normal((m, ldc)).astype(np.float32)
    c0[:, n:] = np.nan
    g_a, g_w, g_c = ga.to_gpu(to_bf16(a)), ga.to_gpu(to_bf16(w)), ga.to_gpu(c0)
    g_b = ga.to_gpu(b) if bias else None
    hg(stream, g_a.ptr, g_w.ptr, g_b.ptr if bias else 0, g_c.ptr, m, n, k, ldc, accumulate=accumulate,
       variant=variant)  # fmt: skip
    stream.synchronize()
    got = g_c.get()
    assert np.isnan(got[:, n:]).all(), "columns past N were written"
    ref = a.astype(np.float64) @ w.astype(np.float64).T
    if bias:
        ref += b
    if accumulate:
        ref += c0[:, :n]
    return got[:, :n], ref


ALL_VARIANTS = list(hopper.VARIANTS + hopper.NARROW)


@gpu
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_small_shapes_every_variant(hg, stream, variant):
    # odd M, N not a tile multiple (odd too), K not a multiple of 64, a single row
    for m, n, k, bias, acc, pad in [(1, 8, 64, False, False, 0), (7, 136, 72, True, False, 2),
                                    (130, 264, 200, False, True, 0), (257, 384, 1024, True, True, 4),
                                    (33, 999, 520, True, False, 1)]:  # fmt: skip
        got, ref = run_numpy(hg, stream, m, n, k, bias=bias, accumulate=acc, pad=pad, variant=variant)
        err = rel_err(got, ref)
        assert err < 1e-5, f"{variant} M={m} N={n} K={k} bias={bias} acc={acc}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_fused_gate_up(hg, stream, variant):
    """act 0 / 1: bf16 silu / gelu_tanh(gate) * up of the interleaved gate|up product in the epilogue."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import from_bf16, interleave_gate_up, to_bf16

    for m, inter, k, act in [(9, 72, 64, 0), (300, 1408, 520, 0), (130, 264, 200, 1)]:
        x = bf(rng.standard_normal((m, k)).astype(np.float32))
        gate = bf((rng.standard_normal((inter, k)) * k**-0.5).astype(np.float32))
        up = bf((rng.standard_normal((inter, k)) * k**-0.5).astype(np.float32))
        g, u = x.astype(np.float64) @ gate.T.astype(np.float64), x.astype(np.float64) @ up.T.astype(np.float64)
        a = 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) if act else g / (1 + np.exp(-g))
        ldc = inter + 2
        g_x, g_w = ga.to_gpu(to_bf16(x)), ga.to_gpu(to_bf16(interleave_gate_up(gate, up)))
        g_o = ga.to_gpu(np.full(m * ldc, 0x7FC0, np.uint16))
        hg(stream, g_x.ptr, g_w.ptr, 0, g_o.ptr, m, 2 * inter, k, ldc, variant=variant, act=act)
        stream.synchronize()
        got = g_o.get().reshape(m, ldc)
        assert (got[:, inter:] == 0x7FC0).all(), "columns past N / 2 were written"
        err = rel_err(from_bf16(got[:, :inter]).reshape(m, inter), a * u)
        assert err < 8e-3, f"{variant} M={m} I={inter} K={k} act={act}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("m", [1, 48, 120])
def test_every_variant_gives_the_same_bits(hg, stream, m):
    """A row's product does not depend on the tile that computed it (each element's k order is the
    same in every variant): a prompt's prefill gives the same bits alone or in a group of spans,
    whichever tile its row count picks."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import to_bf16

    n, k = 1000, 1096
    a = to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    w = to_bf16((rng.standard_normal((n, k)) * k**-0.5).astype(np.float32))
    g_a, g_w = ga.to_gpu(a), ga.to_gpu(w)
    outs = {}
    for variant in ALL_VARIANTS:
        g_c = ga.zeros((m, n), np.float32)
        hg(stream, g_a.ptr, g_w.ptr, 0, g_c.ptr, m, n, k, n, variant=variant)
        stream.synchronize()
        outs[variant] = g_c.get()
    first = outs[ALL_VARIANTS[0]]
    assert all(np.array_equal(first, got) for got in outs.values()), [
        v for v, g in outs.items() if not np.array_equal(first, g)
    ]


@gpu
def test_many_tiles_per_block(hg, stream):
    """More tiles than SMs: each persistent block walks several tiles, the stage ring wraps across them."""
    for variant in [(1, 128), (2, 256), (1, 32), (2, 64)]:
        got, ref = run_numpy(hg, stream, 2100, 2200, 264, bias=True, accumulate=True, variant=variant)
        assert rel_err(got, ref) < 1e-5


@gpu
def test_preconditions(hg, stream):
    with pytest.raises(ValueError, match="K % 8"):
        hg(stream, 0, 0, 0, 0, 16, 16, 12)
    with pytest.raises(ValueError, match="ldc"):
        hg(stream, 0, 0, 0, 0, 16, 16, 16, ldc=17)


@gpu
def test_kernels_linear_routes_to_hopper(hg, stream):
    """``Kernels.linear`` past the GEMV's 8 rows runs gemm_hopper on this device (the prefill path)."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import to_bf16
    from engine.cu.kernels import Kernels

    kern = Kernels(128, 4)
    assert isinstance(kern._gemm, hopper.GemmRoute)
    m, n, k = 300, 520, 256
    a = bf(rng.standard_normal((m, k)).astype(np.float32))
    w = bf(rng.standard_normal((n, k)).astype(np.float32))
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    g_a, g_w, g_c = ga.to_gpu(to_bf16(a)), ga.to_gpu(to_bf16(w)), ga.to_gpu(c0)
    kern.linear(stream, g_a.ptr, g_w.ptr, 0, g_c.ptr, m, n, k, accumulate=True)
    stream.synchronize()
    assert rel_err(g_c.get(), a.astype(np.float64) @ w.T + c0) < 1e-5


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@gpu
@pytest.mark.parametrize("m", [16, 48, 120, 128, 1024, 2048, 8192])
@pytest.mark.parametrize("name", list(SHAPES))
def test_8b_shapes_against_torch(hg, stream, name, m):
    """The model's shapes at prefill row counts: fp32-level agreement with torch's fp32 product of the
    same bf16 operands, bf16-level with torch.matmul in bf16 (cuBLAS); q|k|v with its bias, o and
    down accumulating into the residual as the forward pass calls them."""
    torch = pytest.importorskip("torch")
    n, k = SHAPES[name]
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen) if name == "qkv" else None
    acc = name in ("o", "down")
    c = torch.randn(m, n, device="cuda", generator=gen)
    ref = a.float() @ w.float().t()
    ref_bf16 = torch.matmul(a, w.t()).float()
    if bias is not None:
        ref += bias
        ref_bf16 += bias
    if acc:
        ref += c
        ref_bf16 += c
    torch.cuda.synchronize()
    hg(stream, a.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else 0, c.data_ptr(), m, n, k,
       accumulate=acc)  # fmt: skip
    stream.synchronize()
    err = float((c - ref).norm() / ref.norm())
    err_bf16 = float((c - ref_bf16).norm() / ref_bf16.norm())
    assert err < 1e-4, f"{name} M={m}: rel err {err:.2e} against fp32"
    assert err_bf16 < 8e-3, f"{name} M={m}: rel err {err_bf16:.2e} against torch.matmul bf16"
