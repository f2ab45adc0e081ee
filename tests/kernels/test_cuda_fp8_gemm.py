"""The fp8 prefill path (``cuda.fp8_gemm``): quant_act.cu's quant_act_fp8 (a scale a row) and
quant_act_fp8_g128 (a row and 128-wide block) bit for bit against numpy (engine/loaders/fp8.py's
encode), gemm_hopper.cu's HG_FP8 builds (per channel; 128 x 128 tiles) against the float64 product of
the decoded operands (every tile variant, odd shapes, bias, accumulate), both through
``Kernels.linear`` / ``gate_up_act`` on FP8 and FP8B matrices, and a tiny llama's prefill logits
with it on. Skipped without PyCUDA and a Hopper (sm_90) device."""

from __future__ import annotations

import numpy as np
import pytest

from engine.loaders.fp8 import decode, encode, quantize_fp8
from tests.kernels.gpu import gpu
from tests.kernels.test_cuda_hopper_gemm import _hopper

rng = np.random.default_rng()
VARIANTS = [(2, 256), (2, 128), (1, 256), (1, 128)]


@pytest.fixture(scope="module")
def hg8():
    if not _hopper():
        pytest.skip("needs an sm_90 (Hopper) device")
    from engine.cu import runtime
    from engine.cu.hopper import BLOCK, PER_CHANNEL, HopperGemm

    with runtime.current():
        yield {PER_CHANNEL: HopperGemm(fp8=PER_CHANNEL), BLOCK: HopperGemm(fp8=BLOCK)}


@pytest.fixture(scope="module")
def stream(hg8):
    import pycuda.driver as cuda

    return cuda.Stream()


@pytest.fixture(scope="module")
def kern(hg8):
    import pycuda.driver as cuda

    from engine.cu.kernels import Kernels
    from engine.cu.quant import FP8_FORMATS

    k = Kernels(64, 2, formats=FP8_FORMATS, fp8_gemm=True)
    assert set(k._fp8) == set(FP8_FORMATS)
    nbytes = 16 << 20
    scratch = cuda.mem_alloc(nbytes)
    k.scratch, k.scratch_bytes = int(scratch), nbytes
    yield k
    scratch.free()


@pytest.fixture(autouse=True)
def _release():
    from tests.kernels.test_cuda_kernels import _live

    yield
    _live.clear()


def quantize_rows(x: np.ndarray, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """quant_act_fp8's numpy model: a scale amax / 448 a row (1 for zeros), codes encode(x / scale);
    ``group`` 128: quant_act_fp8_g128's, a scale a row and block of 128 ([M, ceil(K / 128)])."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    g = group or k
    blocks = -(-k // g)
    padded = np.zeros((m, blocks * g), np.float32)
    padded[:, :k] = x
    amax = np.abs(padded.reshape(m, blocks, g)).max(axis=2)
    sa = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    q = encode(padded.reshape(m, blocks, g) / sa[:, :, None]).reshape(m, blocks * g)[:, :k]
    return q, sa if group else sa[:, 0]


def dequantize_rows(q: np.ndarray, sa: np.ndarray) -> np.ndarray:
    """float64 x back from ``quantize_rows``' codes and scales (a row's, or a row and block's)."""
    d = decode(q).astype(np.float64)
    if sa.ndim == 1:
        return d * sa[:, None]
    return d * np.repeat(sa, 128, axis=1)[:, : q.shape[1]]


def acc_slack(k: int) -> float:
    """The error bound, in units of sum |a||w|, of an fp8 wgmma accumulation over k: Hopper's fp8 MMA does
    not keep fp32's 24 bits while it adds (about 14 for the running sum, the DeepSeek-V3 report; the
    products of one 32-wide step are aligned to the largest and truncated). Measured on an H100 with
    codes over the whole e4m3 range: up to ~2^-11.5 of the bound at K 16; 2^-10 a step is the budget."""
    return 2.0**-10 * -(-k // 32)


def random_codes(shape) -> np.ndarray:
    """e4m3 codes as a row of real data quantizes to: normal values scaled so a row's largest is 448 (a
    weight's or an activation's row under amax / 448), some rows with tiny values (subnormal codes)."""
    v = rng.standard_normal(shape).astype(np.float32)
    v *= np.float32(448) / np.abs(v).max(axis=-1, keepdims=True)
    tiny = rng.random(shape[0]) < 0.1
    v[tiny] *= np.float32(2**-12)
    return encode(np.clip(v, -448, 448))


@gpu
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("m,k", [(1, 16), (37, 208), (300, 4096), (9, 14336)])
def test_quant_act_fp8_is_exact(kern, stream, m, k, group):
    """Codes and scales bit for bit as numpy's encode of x / (amax / 448) over a row (or a row's block of
    128; a zero row or block: scale 1), K not a multiple of 128 included."""
    from engine.cu.quant import FP8, FP8B, QF8_THREADS
    from tests.kernels.test_cuda_kernels import bf, get, put

    x = bf(rng.standard_normal((m, k)).astype(np.float32) * np.exp2(rng.uniform(-20, 20, (m, 1))).astype(np.float32))
    x[m // 2] = 0
    if group and k > 256:
        x[0, 128:256] = 0
    want_q, want_s = quantize_rows(x, group)
    q = put(np.zeros(m * k, np.uint8))
    sa = put(np.full(want_s.size, np.nan, np.float32))
    quantizer = kern._fp8[FP8B if group else FP8][1]
    grid = m if group is None else -(-want_s.size // (QF8_THREADS // 32))
    quantizer(stream, (grid,), x=put(x, True).ptr, q=q.ptr, sa=sa.ptr, M=m, K=k)
    stream.synchronize()
    assert np.array_equal(get(sa).reshape(want_s.shape), want_s)
    assert np.array_equal(get(q).reshape(m, k), want_q)


def run_gemm(hg8, stream, m, n, k, *, bias=False, accumulate=False, pad=0, variant=None, block=False):
    """One product through gemm_hopper_fp8 (``block``: _fp8b, scales a row / column and 128-wide k block) on
    fresh random codes and scales; (got, reference, sum of |terms|)."""
    import pycuda.gpuarray as ga

    from engine.cu.hopper import BLOCK, PER_CHANNEL

    kb = -(-k // 128)
    a, w = random_codes((m, k)), random_codes((n, k))
    sa = rng.uniform(0.01, 2, (m, kb) if block else m).astype(np.float32)
    sw = rng.uniform(0.01, 2, (n, kb) if block else n).astype(np.float32)  # every row its own (rows permute)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    ldc = n + pad
    c0 = rng.standard_normal((m, ldc)).astype(np.float32)
    c0[:, n:] = np.nan
    g = {name: ga.to_gpu(v) for name, v in (("a", a), ("w", w), ("sa", sa), ("sw", sw), ("c", c0))}
    g_b = ga.to_gpu(b) if bias else None
    hg8[BLOCK if block else PER_CHANNEL](stream, g["a"].ptr, g["w"].ptr, g_b.ptr if bias else 0, g["c"].ptr, m, n,
                                         k, ldc, accumulate=accumulate, variant=variant, sa=g["sa"].ptr,
                                         sw=g["sw"].ptr)  # fmt: skip
    stream.synchronize()
    got = g["c"].get()
    assert np.isnan(got[:, n:]).all(), "columns past N were written"
    if block:
        da, dw = dequantize_rows(a, sa), dequantize_rows(w, sw)
        ref, bound = da @ dw.T, np.abs(da) @ np.abs(dw).T
    else:
        da, dw = decode(a).astype(np.float64), decode(w).astype(np.float64)
        ref = (da @ dw.T) * sa[:, None].astype(np.float64) * sw[None, :].astype(np.float64)
        bound = (np.abs(da) @ np.abs(dw).T) * sa[:, None] * sw[None, :]
    if bias:
        ref += b
    if accumulate:
        ref += c0[:, :n]
    return got[:, :n], ref, bound


@gpu
@pytest.mark.parametrize("variant,block", [(v, False) for v in VARIANTS] + [((2, 128), True), ((1, 128), True)])
def test_gemm_fp8_every_variant(hg8, stream, variant, block):
    """Odd M, N past a tile, K not a multiple of 128 (the TMA's zero fill), a single row, several tiles a
    block: within the fp8 MMA's accumulation (``acc_slack``) of the exact float64 product of the decoded
    operands, and within 1e-3 of it overall."""
    for m, n, k, bias, acc, pad in [(1, 8, 16, False, False, 0), (7, 136, 80, True, False, 2),
                                    (130, 264, 208, False, True, 0), (257, 384, 1024, True, True, 4),
                                    (33, 999, 528, True, False, 1), (2100, 2200, 272, True, True, 0)]:  # fmt: skip
        got, ref, bound = run_gemm(hg8, stream, m, n, k, bias=bias, accumulate=acc, pad=pad, variant=variant,
                                   block=block)  # fmt: skip
        slack = acc_slack(min(k, 128) if block else k) * bound + 1e-5 * np.abs(ref)
        assert np.all(np.abs(got - ref) <= slack), f"{variant} M={m} N={n} K={k}: {np.abs(got - ref).max():.3g}"
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < 1e-3, f"{variant} M={m} N={n} K={k}: rel err {rel:.2e}"


@gpu
def test_gemm_fp8_preconditions(hg8, stream):
    for g in hg8.values():
        with pytest.raises(ValueError, match="K % 16"):
            g(stream, 0, 0, 0, 0, 16, 16, 24, sa=16, sw=16)
        with pytest.raises(ValueError, match="scale"):
            g(stream, 0, 0, 0, 0, 16, 16, 32)


@gpu
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("rows", [9, 40, 300])
def test_linear_runs_the_fp8_gemm(kern, stream, rows, block):
    """``Kernels.linear`` past the GEMV's rows on an FP8 matrix: x quantized a row, the fp8 product, bias and
    the residual add; against numpy's model of the same quantization (fp32-close) and against the
    exact product of x with the fp8 weights (within e4m3's rounding of x)."""
    from tests.kernels.test_cuda_fp8 import fp8_matrix
    from tests.kernels.test_cuda_kernels import bf, get, put

    n, k = 520, 1040
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2, (n, 1)).astype(np.float32) / 32
    q = quantize_fp8(w, block)
    x = bf(rng.standard_normal((rows, k)).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32)
    c0 = rng.standard_normal((rows, n)).astype(np.float32)
    g_o = put(c0.copy())
    kern.linear(stream, put(x, True).ptr, fp8_matrix(q), put(b).ptr, g_o.ptr, rows, n, k, accumulate=True)
    stream.synchronize()
    got = get(g_o).reshape(rows, n) - c0 - b
    xd = dequantize_rows(*quantize_rows(x, block))
    wq = q.dequantize().astype(np.float64)
    model, bound = xd @ wq.T, np.abs(xd) @ np.abs(wq).T
    assert np.all(np.abs(got - model) <= acc_slack(128 if block else k) * bound + 1e-4), np.abs(got - model).max()
    exact = x.astype(np.float64) @ wq.T
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 0.05, rel  # e4m3's 3 mantissa bits on x: ~2-3% rms


@gpu
@pytest.mark.parametrize("block", [None, 128])
def test_gate_up_act_runs_the_fp8_gemm(kern, stream, block):
    """The fused SwiGLU epilogue on an FP8 / FP8B gate|up matrix (interleaved as the backend stores it:
    a tile of the interleaved matrix mixes gate and up rows, so a column's tile scale is its own)."""
    from engine.backends.cuda.weights import from_bf16
    from tests.kernels.test_cuda_fp8 import fp8_matrix as stack
    from tests.kernels.test_cuda_kernels import bf, get, put

    rows, inter, k = 200, 704, 512
    gate, up = (rng.standard_normal((inter, k)).astype(np.float32) * k**-0.5 for _ in range(2))
    gate[: inter // 2] *= 8  # the gate's tiles and the up's of very different scales
    qg, qu = quantize_fp8(gate, block), quantize_fp8(up, block)
    x = bf(rng.standard_normal((rows, k)).astype(np.float32))
    g_o = put(np.full(rows * inter, 0x7FC0, np.uint16))
    kern.gate_up_act(stream, put(x, True).ptr, stack(qg, qu, interleave=True), 0, g_o.ptr, rows, inter, k)
    stream.synchronize()
    xd = dequantize_rows(*quantize_rows(x, block))
    g, u = xd @ qg.dequantize().T, xd @ qu.dequantize().T
    want = g / (1 + np.exp(-g)) * u
    got = from_bf16(get(g_o)).reshape(rows, inter)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 8e-3


@gpu
@pytest.mark.parametrize("block", [None, 128])
def test_tiny_llama_fp8_gemm_prefill(hg8, block):
    """A 3-layer llama quantized per output channel (or in 128 x 128 tiles), prefill of 40 and 200 tokens (the GEMM's rows) with
    cuda.fp8_gemm on: logits within cosine 0.995 of the numpy backend on the dequantized weights (its
    activations bf16-exact), and close to the same backend with fp8_gemm off (the dequant + bf16 GEMM)."""
    from engine.backends import create_backend
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.loaders.fp8 import Fp8Tensor, quantize_weights
    from tests.kernels.test_cuda_fp8 import tiny_llama_floats
    from tests.kernels.test_cuda_model import cosine, prefill_logits

    cfg, floats = tiny_llama_floats(rng)
    q = quantize_weights(floats, block)
    deq = {n: t.dequantize() if isinstance(t, Fp8Tensor) else t for n, t in q.items()}
    ref = create_backend("numpy")
    ref.load(cfg, deq, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
    logits = {}
    try:
        for on in (True, False):
            be = CudaBackend(CudaTuning(fp8_gemm=on))
            be.load(cfg, q, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
            try:
                assert bool(be.kern._fp8) == on
                for n in (40, 200):
                    ids = np.random.default_rng(n).integers(0, cfg.vocab_size, n).tolist()
                    logits[(on, n)] = prefill_logits(be, ids, list(range(-(-n // 16))))
                    if on:
                        logits[("numpy", n)] = prefill_logits(ref, ids, list(range(-(-n // 16))))
            finally:
                be.unload()
    finally:
        ref.unload()
    for n in (40, 200):
        assert cosine(logits[(False, n)], logits[("numpy", n)]) >= 0.999
        assert cosine(logits[(True, n)], logits[("numpy", n)]) >= 0.995, cosine(logits[(True, n)], logits[("numpy", n)])


def test_the_key_reaches_the_kernels():
    """``cuda.fp8_gemm`` reaches CudaTuning and the backend's ``Kernels`` (no card)."""
    import inspect

    from engine.backends.cuda import backend
    from engine.config import CudaTuning
    from ignis_site import config

    default = CudaTuning().fp8_gemm
    assert config.FIELDS["cuda.fp8_gemm"].default is default
    values, _ = config.resolve(environ={"IGNIS_CUDA_FP8_GEMM": "off" if default else "on"})
    assert CudaTuning(**config.cuda_tuning_dict(values)).fp8_gemm is not default
    assert "fp8_gemm=t.fp8_gemm" in inspect.getsource(backend.CudaBackend._kernels)


def test_fp8_prefill_routes_by_format_rows_and_room():
    """``Kernels.fp8_prefill``'s host side against stand-in kernels (no card): x quantized once into the
    scratch, one GEMM a part over its columns with the part's own scales, the tile-scaled build only up
    to ``FP8B_TC_MAX_ROWS`` rows, and nothing launched where it does not apply."""
    from engine.cu.hopper import BLOCK, PER_CHANNEL
    from engine.cu.kernels import FP8B_TC_MAX_ROWS, Kernels
    from engine.cu.quant import BF16, FP8, FP8B, QF8_THREADS, Matrix, Part

    calls = []

    def gemm(s, q, w, bias, out, m, n, k, ldo, act=-1, accumulate=False, sa=0, sw=0):
        calls.append(("gemm", q, w, bias, out, m, n, k, ldo, act, accumulate, sa, sw))

    def quantizer(s, grid, **kw):
        calls.append(("quant", grid, kw))

    kern = Kernels.__new__(Kernels)  # only fp8_prefill's state: no device
    kern._fp8 = {FP8: (gemm, quantizer, PER_CHANNEL), FP8B: (gemm, quantizer, BLOCK)}
    kern.scratch, kern.scratch_bytes = 1 << 20, 1 << 20
    x, bias, out, k = 1 << 24, 1 << 25, 1 << 26, 256
    two = Matrix((Part(4096, FP8, 32), Part(65536, FP8, 32)), k)  # a q|k|v of two parts
    assert kern.fp8_prefill(None, x, two, bias, out, 100, 64, k, 64, accumulate=True)
    sa = kern.scratch + 100 * k  # 16-byte aligned already
    assert calls == [
        ("quant", (100,), dict(x=x, q=kern.scratch, sa=sa, M=100, K=k)),
        ("gemm", kern.scratch, 4096, bias, out, 100, 32, k, 64, -1, True, sa, 4096 + 32 * k),
        ("gemm", kern.scratch, 65536, bias + 128, out + 128, 100, 32, k, 64, -1, True, sa, 65536 + 32 * k),
    ]
    calls.clear()
    tiles = Matrix((Part(4096, FP8B, 64),), k)
    rows = FP8B_TC_MAX_ROWS
    assert kern.fp8_prefill(None, x, tiles, 0, out, rows, 64, k, 32, act=0)  # the fused gate|up
    assert calls[0] == ("quant", (-(-rows * 2 // (QF8_THREADS // 32)),), dict(x=x, q=kern.scratch,
                        sa=kern.scratch + rows * k, M=rows, K=k))  # fmt: skip
    assert calls[1] == ("gemm", kern.scratch, 4096, 0, out, rows, 64, k, 32, 0, False, kern.scratch + rows * k,
                        4096 + 64 * k)  # fmt: skip
    calls.clear()
    for w, rows, kk, xx, n in [
        (tiles, FP8B_TC_MAX_ROWS + 1, k, x, 64),  # wider: the dequant path was faster there
        (Matrix.bf16(4096, 64, k), 100, k, x, 64),  # not fp8
        (Matrix((Part(4096, FP8, 32), Part(65536, BF16, 32)), k), 100, k, x, 64),  # mixed parts
        (two, 100, k, x + 8, 64),  # x unaligned for the TMA
        (two, 100, k, x, 48),  # a shape that is not the matrix's
        (Matrix((Part(4096, FP8, 64),), 4104), 100, 4104, x, 64),  # K % 16
        (two, 5000, k, x, 64),  # x's bytes do not fit the scratch
        (Matrix((Part(4096, FP8, 33), Part(65536, FP8, 31)), k), 100, k, x, 64),  # part 2's columns unaligned
    ]:
        assert not kern.fp8_prefill(None, xx, w, 0, out, rows, n, kk, n)
    assert not kern.fp8_prefill(None, x, two, 0, out, 100, 64, k, 32, act=0)  # the fused gate|up takes one part
    assert calls == []
