"""Int8 activations for the quantized GEMV (``cuda.quant_activations``: engine/cu/quant_act.cu's
quantizer, gemv_q.cu's QACT8 main loop). On the CPU: numpy models of the quantizer (ints and float
scales as the kernel computes them) and of the int8 product per GGUF format (the quants as
integers, the group scales and mins), checked against gguf's dequantize; the key reaching
``CudaTuning`` and ``Kernels``. On the card: the quantizer bit-exact against its model, every int8
GEMV epilogue against the model of the int8 product (tight: the integer part is exact), widths 1..8
with a row's bits the same at every width, K = 4096 and 14336, rows past a multiple of 16, the
rope epilogue over a q|k|v of two formats sharing one quantized x, and a tiny Q4_K_M-like llama
whose logits with the key on stay close to off."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import gpu
from tests.kernels.test_cuda_quant import FORMATS, random_blocks, reference

rng = np.random.default_rng()
OFF = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}


# --- numpy models -----------------------------------------------------------------------------


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float32."""
    from engine.backends.cuda.weights import to_bf16

    return (to_bf16(np.asarray(a, np.float32)).astype(np.uint32) << 16).view(np.float32)


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quant_act.cu in numpy: float32 x [M, K] (bf16 values) -> (qx int8 [M, K], dx, dx * xsum float32
    [M, K / 32]), every float step one float32 operation as the kernel's."""
    m, k = x.shape
    g = np.asarray(x, np.float32).reshape(m, k // 32, 32)
    amax = np.abs(g).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((g * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int32)
    dxs = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(m, k).astype(np.int8), d, dxs


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    return b[..., off : off + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins [..., 8] from the 12 scale bytes."""
    sc = sc.astype(np.int32)
    s = np.empty(sc.shape[:-1] + (8,), np.int32)
    m = np.empty_like(s)
    for j in range(8):
        if j < 4:
            s[..., j], m[..., j] = sc[..., j] & 63, sc[..., j + 4] & 63
        else:
            s[..., j] = (sc[..., j + 4] & 0xF) | ((sc[..., j - 4] >> 6) << 4)
            m[..., j] = (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)
    return s, m


def decode_int(fmt: str, blocks: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A format's rows as the int8 GEMV reads them: (q - OFF int32 [N, K], s float32 [N, K / 16] (a scale
    per 16 values; per 32 but for Q6_K), mn float32 [N, K / 32]), w = s (q - OFF) + mn."""
    from engine.cu.quant import QUANT_FORMATS

    _, qk, bb = QUANT_FORMATS[fmt]
    n = blocks.shape[0]
    b = blocks.reshape(n, k // qk, bb)
    nb = k // qk
    zero = np.zeros((n, nb), np.float32)
    if qk == 32:
        d = _f16(b, 0)
        mn = _f16(b, 2) if fmt in ("Q4_1", "Q5_1") else zero
        if fmt == "Q8_0":
            q = b[:, :, 2:34].view(np.int8).astype(np.int32)
        else:
            qs = b[:, :, {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[fmt] :][:, :, :16].astype(np.int32)
            q = np.concatenate([qs & 15, qs >> 4], -1)
            if fmt in ("Q5_0", "Q5_1"):
                o = 2 if fmt == "Q5_0" else 4
                qh = b[:, :, o : o + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
                q = q | (((qh[..., None] >> np.arange(32)) & 1) << 4).astype(np.int32)
            q = q - OFF.get(fmt, 0)
        s = np.repeat(d, 2, -1)
        return q.reshape(n, k), s, mn
    d = _f16(b, 208 if fmt == "Q6_K" else 0)
    if fmt == "Q6_K":
        ql, qh = b[:, :, :128].astype(np.int32), b[:, :, 128:192].astype(np.int32)
        sc = b[:, :, 192:208].view(np.int8).astype(np.float32)
        q = np.empty((n, nb, 256), np.int32)
        for half in range(2):
            for a in range(4):
                lo = ql[:, :, 64 * half + 32 * (a & 1) : 64 * half + 32 * (a & 1) + 32]
                lo = (lo >> 4) if a >> 1 else (lo & 15)
                hi = (qh[:, :, 32 * half : 32 * half + 32] >> (2 * a)) & 3
                q[:, :, 128 * half + 32 * a : 128 * half + 32 * a + 32] = lo | (hi << 4)
        s = (d[..., None] * sc).astype(np.float32)  # [n, nb, 16]
        return (q - 32).reshape(n, k), s.reshape(n, -1), np.zeros((n, k // 32), np.float32)
    dmin = _f16(b, 2)
    sc6, m6 = _k_scale_min(b[:, :, 4:16])
    s = (d[..., None] * sc6.astype(np.float32)).astype(np.float32)  # [n, nb, 8]
    mn = -(dmin[..., None] * m6.astype(np.float32)).astype(np.float32)
    qs = b[:, :, 16:144] if fmt == "Q4_K" else b[:, :, 48:176]
    q = np.empty((n, nb, 256), np.int32)
    for c in range(4):
        chunk = qs[:, :, 32 * c : 32 * c + 32].astype(np.int32)
        q[:, :, 64 * c : 64 * c + 32], q[:, :, 64 * c + 32 : 64 * c + 64] = chunk & 15, chunk >> 4
    if fmt == "Q5_K":
        qh = b[:, :, 16:48].astype(np.int32)
        for j in range(8):
            q[:, :, 32 * j : 32 * j + 32] |= ((qh >> j) & 1) << 4
    return q.reshape(n, k), np.repeat(s, 2, -1).reshape(n, -1), mn.reshape(n, -1)


def int8_product(fmt: str, blocks: np.ndarray, k: int, x: np.ndarray) -> np.ndarray:
    """What the QACT8 GEMV computes for bf16 rows x [M, K] (float32 values): float64 [M, N] of
    sum over groups (s dx) dot + mn (dx xsum), Q6_K's two halves of a group each with its scale."""
    q, s16, mn = decode_int(fmt, blocks, k)
    qx, dx, dxs = quantize_act(x)
    m, n = x.shape[0], q.shape[0]
    dot = np.einsum("ngh,mgh->mng", q.reshape(n, k // 16, 16).astype(np.int64),
                    qx.reshape(m, k // 16, 16).astype(np.int64))  # fmt: skip
    dx16 = np.repeat(dx, 2, -1).astype(np.float64)
    out = np.einsum("mng,ng,mg->mn", dot.astype(np.float64), s16.astype(np.float64), dx16)
    return out + dxs.astype(np.float64) @ mn.astype(np.float64).T


# --- CPU --------------------------------------------------------------------------------------


def test_quantizer_model_rounds_and_bounds():
    """The model's ints are round-to-nearest of x / dx within +-127, the largest value of a group maps to
    +-127, an all-zero group gives zeros with dx 0, and a row's result does not depend on the others."""
    x = bf16_round(rng.standard_normal((3, 256)).astype(np.float32) * 3)
    x[1, 32:64] = 0
    qx, dx, dxs = quantize_act(x)
    assert qx.dtype == np.int8 and np.abs(qx.astype(np.int32)).max() == 127
    assert dx[1, 1] == 0 and not qx[1, 32:64].any() and dxs[1, 1] == 0
    g = x.reshape(3, 8, 32)
    with np.errstate(invalid="ignore"):
        want = np.rint(g / dx[..., None].astype(np.float64))
    want[1, 1] = 0
    assert np.abs(qx.reshape(3, 8, 32) - want).max() <= 1  # fp32 1 / dx against the float64 quotient
    assert (np.abs(qx.reshape(3, 8, 32)).max(-1)[dx != 0] == 127).all()
    np.testing.assert_array_equal(dxs, (dx * qx.reshape(3, 8, 32).sum(-1, dtype=np.int32)).astype(np.float32))
    q1 = quantize_act(x[2:3])
    for a, b in zip(q1, (qx[2:3], dx[2:3], dxs[2:3])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int_decode_matches_gguf(fmt):
    """The models' integer view of every format gives back gguf's dequantized weights: s (q - OFF) + mn."""
    k = 512 if fmt.endswith("_K") else 576
    blocks = random_blocks(fmt, 24, k, gen=rng)
    q, s16, mn = decode_int(fmt, blocks, k)
    if fmt not in ("Q8_0", "Q6_K"):
        lo, hi = -OFF.get(fmt, 0), (31 if fmt.startswith("Q5") else 15) - OFF.get(fmt, 0)
        assert q.min() >= lo and q.max() <= hi
    w = np.repeat(s16, 16, -1).astype(np.float64) * q + np.repeat(mn, 32, -1)
    ref = reference(fmt, blocks).astype(np.float64)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_product_model_close_to_dequantized(fmt):
    """The int8 product's model against bf16 x times gguf's dequantized weights in float64: within what a
    per-32 int8 rounding of x gives (about 1 / (127 sqrt 12) of a group's largest value an element)."""
    k = 1024
    blocks = random_blocks(fmt, 64, k, scale=0.2 / np.sqrt(k), gen=rng)
    x = bf16_round(rng.standard_normal((8, k)).astype(np.float32) * 2)
    got, want = int8_product(fmt, blocks, k, x), x.astype(np.float64) @ reference(fmt, blocks).T.astype(np.float64)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err < 2e-2, err


def test_quant_activations_key_reaches_kernels():
    """``cuda.quant_activations`` (off by default until the card says so) reaches CudaTuning and the
    backend's ``Kernels``; retune hands the kernels the activation buffer again."""
    import inspect

    from engine.backends.cuda import backend
    from engine.config import CudaTuning
    from ignis_site import config

    assert config.FIELDS["cuda.quant_activations"].default is False and CudaTuning().quant_activations is False
    values, _ = config.resolve(environ={"IGNIS_CUDA_QUANT_ACTIVATIONS": "on"})
    assert CudaTuning(**config.cuda_tuning_dict(values)).quant_activations is True
    assert "quant_act=t.quant_activations" in inspect.getsource(backend.CudaBackend._kernels)
    assert "self.kern.qact, self.kern.qact_bytes = self.qact" in inspect.getsource(backend.CudaBackend.retune)


def test_gemv_quantizes_x_once_per_call():
    """Kernels._gemv_tc with the key on: one quantizer launch a call, before the parts; block-format parts
    run the QACT8 GEMV on the quantized buffer, an FP8 part the bf16-x GEMV on x; with the key off, no
    quantizer and every part on x (launches recorded, no card)."""
    from engine.cu.kernels import STORE, Kernels
    from engine.cu.quant import FP8, Matrix, Part, quant_act_bytes

    calls = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __call__(self, s, grid, **kw):
            calls.append((self.name, kw.get("x"), kw.get("q"), kw.get("M"), kw.get("K")))

    class QK:
        def __init__(self, name):
            self.gemv = {STORE: Rec(name)}

        def grid(self, rows, persist):
            return (-(-rows // 16),)

    k = object.__new__(Kernels)
    k.quant_act, k.qact, k.qact_bytes, k.quant_persist = True, 0x9000, quant_act_bytes(4096), False
    k._quant_act = Rec("quantize")
    k.quant = lambda fmt: QK("bf16x:" + fmt)
    k.quant8 = lambda fmt: QK("int8x:" + fmt)
    mat = Matrix((Part(0x1000, "Q4_K", 64), Part(0x2000, "Q6_K", 32), Part(0x3000, FP8, 16)), 4096)
    k._gemv_tc(None, STORE, 0x5000, mat, 0x7000, 3, 112, 4096, 112, (0, 0), 0.0, bias=0, nw=0, xw=0, ss_out=0)
    assert calls == [("quantize", 0x5000, 0x9000, 3, 4096), ("int8x:Q4_K", 0x9000, None, 3, 4096),
                     ("int8x:Q6_K", 0x9000, None, 3, 4096), ("bf16x:FP8", 0x5000, None, 3, 4096)]  # fmt: skip
    calls.clear()
    k.quant_act = False
    k._gemv_tc(None, STORE, 0x5000, mat, 0x7000, 3, 112, 4096, 112, (0, 0), 0.0, bias=0, nw=0, xw=0, ss_out=0)
    assert [c[:2] for c in calls] == [("bf16x:Q4_K", 0x5000), ("bf16x:Q6_K", 0x5000), ("bf16x:FP8", 0x5000)]
    k.quant_act, k.qact_bytes = True, quant_act_bytes(1024)
    with pytest.raises(ValueError, match="activation buffer"):
        k._gemv_tc(None, STORE, 0x5000, mat, 0x7000, 3, 112, 4096, 112, (0, 0), 0.0, bias=0, nw=0, xw=0, ss_out=0)


# --- on the card ------------------------------------------------------------------------------

KMAX = 14336


@pytest.fixture(scope="module")
def dev():
    from tests.kernels.gpu import cuda_available

    if not cuda_available():
        pytest.skip("needs PyCUDA and a CUDA device")
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def kern(dev):
    from engine.cu.kernels import Kernels
    from engine.cu.quant import quant_act_bytes

    k = Kernels(64, 2, formats=FORMATS, quant_act=True)
    buf = dev.mem_alloc(quant_act_bytes(KMAX))
    dev.memset_d8(int(buf), 0, quant_act_bytes(KMAX))
    k.qact, k.qact_bytes = int(buf), quant_act_bytes(KMAX)
    yield k
    buf.free()


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


@pytest.fixture(autouse=True)
def _release():
    yield
    from tests.kernels.test_cuda_kernels import _live

    _live.clear()


def _matrix(fmt, blocks, k):
    from tests.kernels.test_cuda_quant import matrix

    return matrix(fmt, blocks, k)


@gpu
@pytest.mark.parametrize("k", [576, 4096, KMAX])
def test_quantizer_bit_exact(kern, stream, k):
    """quant_act.cu against the numpy model: the int8 rows and both float scales bit for bit at every
    width 1..8 (a row's result the same at each), an all-zero group and a huge one included."""
    from engine.cu.quant import quant_act_bytes
    from tests.kernels.test_cuda_kernels import bf, get, put

    x32 = rng.standard_normal((8, k)).astype(np.float32) * np.exp(rng.standard_normal((8, 1)))
    x32[3, 64:96] = 0
    x32[5, :32] *= 1e30
    xb = bf(x32)
    x = np.asarray(xb, np.float32)  # bf() gives the bf16 values as float32
    g_x = put(xb, True)
    for rows in range(1, 9):
        g_q = put(np.full(quant_act_bytes(k), 0xAB, np.uint8))
        kern.quantize_act(stream, g_x.ptr, rows, k, out=g_q.ptr)
        stream.synchronize()
        raw = get(g_q).view(np.uint8)
        qx, dx, dxs = quantize_act(x[:rows])
        np.testing.assert_array_equal(raw[: rows * k].view(np.int8).reshape(rows, k), qx)
        sc = raw[rows * k : rows * k + (k // 32) * 64].view(np.float32).reshape(k // 32, 8, 2)
        np.testing.assert_array_equal(sc[:, :rows, 0].T.view(np.uint32), dx.view(np.uint32))
        np.testing.assert_array_equal(sc[:, :rows, 1].T.view(np.uint32), dxs.view(np.uint32))


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epi", ["store", "acc", "swiglu", "geglu"])
def test_int8_gemv_epilogues(kern, stream, fmt, epi):
    """Every linear epilogue of the QACT8 GEMV over ``fmt`` at widths 1..8 against the numpy model of the
    int8 product (gemv_checks.check_epilogue with its ``product``), a row's bits the same at each width."""
    from engine.backends.cuda.weights import interleave_gate_up
    from tests.kernels.gemv_checks import check_epilogue

    k = 512 if fmt.endswith("_K") else 576
    n = 200 if epi in ("store", "acc") else 2 * 96
    blocks = random_blocks(fmt, n, k, scale=0.2 / np.sqrt(k))
    if epi in ("swiglu", "geglu"):
        blocks = interleave_gate_up(blocks[: n // 2], blocks[n // 2 :])

    def product(xb, blocks=blocks):
        return int8_product(fmt, blocks, k, np.asarray(xb, np.float32))

    check_epilogue(kern, stream, epi, _matrix(fmt, blocks, k), reference(fmt, blocks), rng, fmt, product=product,
                   tol=2e-5, widths=tuple(range(1, 9)))  # fmt: skip


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [4096, KMAX])
def test_int8_gemv_large_k(kern, stream, fmt, k):
    """K of the 8B shape's q|k|v and down matrices (many stages, a last stage partly filled for some
    tunings), 40 rows (a last tile of 8): store and acc against the int8 model at widths 1..8."""
    from tests.kernels.gemv_checks import check_epilogue

    n = 40
    blocks = random_blocks(fmt, n, k, scale=0.2 / np.sqrt(k))

    def product(xb):
        return int8_product(fmt, blocks, k, np.asarray(xb, np.float32))

    for epi in ("store", "acc"):
        check_epilogue(kern, stream, epi, _matrix(fmt, blocks, k), reference(fmt, blocks), rng, fmt, product=product,
                       tol=2e-5, widths=tuple(range(1, 9)))  # fmt: skip


@gpu
@pytest.mark.parametrize("fmt,vfmt", [("Q4_K", "Q6_K"), ("Q4_0", "Q8_0"), ("Q5_K", "Q8_0")])
def test_int8_qkv_rope_two_formats(kern, stream, fmt, vfmt):
    """The rope + KV-write epilogue over a q|k|v of two formats (one quantized x for both parts) against
    the int8 model at widths 1, 2, 8; row 0 bitwise the same at every width (gemv_checks.check_qkv_rope)."""
    from tests.kernels.gemv_checks import check_qkv_rope
    from tests.kernels.test_cuda_kernels import bf

    k = 512

    def product(b_qk, b_v, hres, nw, eps, rows):
        x = np.asarray(bf(hres * nw), np.float32)  # bf() gives the bf16 values as float32
        rs = 1 / np.sqrt((hres[:rows].astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
        p = np.concatenate([int8_product(fmt, b_qk, k, x[:rows]), int8_product(vfmt, b_v, k, x[:rows])], -1)
        return rs * p

    check_qkv_rope(kern, stream, fmt, vfmt, k, product, 5e-3, rng)


@gpu
def test_tiny_q4_k_m_llama_key_on_close_to_off(dev):
    """A 3-layer llama stored as a Q4_K_M file stores it (Q4_K, Q6_K v / down / head, Q5_K o): prefill
    logits of 1 and 5 tokens (the GEMV path) with ``cuda.quant_activations`` on against off, cosine above
    0.999; with the key on, greedy decode tokens and logprobs the same at widths 1 and 4."""
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning
    from engine.loaders.gguf import BLOCK_TYPES, QuantizedTensor
    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.test_cuda_model import _run_lanes, cosine, prefill_logits
    from tests.kernels.test_cuda_quant import TINY_FORMATS, blocks_with_std

    cfg = ModelConfig(arch="llama", vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=3,
                      num_heads=8, num_kv_heads=2, head_dim=64, max_position=4096, tie_word_embeddings=False)  # fmt: skip
    stored = {}
    for name, shape in definition("llama").tensors(cfg).items():
        if len(shape) == 1:
            stored[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        fmt = TINY_FORMATS[name.split(".")[-2]][0]
        b = blocks_with_std(fmt, shape[0], shape[1], 1.0 if "embed" in name else shape[1] ** -0.5)
        stored[name] = QuantizedTensor(BLOCK_TYPES[fmt][0], shape, b)
    bes = {}
    for on in (False, True):
        be = CudaBackend(CudaTuning(quant_activations=on))
        be.load(cfg, stored, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
        bes[on] = be
    try:
        assert bes[True].kern.quant_act and bes[True].kern.qact_bytes >= 8 * cfg.intermediate_size
        for n in (1, 5):
            ids = rng.integers(0, cfg.vocab_size, n).tolist()
            table = list(range(-(-n // 16)))
            off, on = prefill_logits(bes[False], ids, table), prefill_logits(bes[True], ids, table)
            assert cosine(on, off) > 0.999, (n, cosine(on, off))
        prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(5, 30))).tolist() for _ in range(4)]
        tables = [list(range(i * 4, i * 4 + 4)) for i in range(4)]
        t1, l1 = _run_lanes(bes[True], prompts, tables, 12, 1)
        t4, l4 = _run_lanes(bes[True], prompts, tables, 12, 4)
        assert t1 == t4 and l1 == l4
    finally:
        for be in bes.values():
            be.unload()
