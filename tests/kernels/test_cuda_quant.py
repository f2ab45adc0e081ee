"""GGUF block formats on the CUDA backend (engine/cu/gemv_q.cu): the dequant against the gguf
package's own ``dequantize`` on fresh random blocks (bit-exact in fp32), every quantized GEMV
epilogue at widths 1, 2 and 8 against numpy (and a lane's result independent of the width),
the prefill path (dequant + GEMM), and the SmolLM2 Q4_1 GGUF served with its weights kept as
Q4_1 against the numpy backend. Skipped without PyCUDA and a CUDA device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = requires_cuda

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of a block's fp16 fields (d, and m / dmin): random bytes there could be inf or NaN.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip
rng = np.random.default_rng()


def random_blocks(fmt: str, rows: int, k: int, scale: float = 0.02, gen=None) -> np.ndarray:
    """Valid ``fmt`` rows [rows, row_bytes]: random bytes for the quants and scales, finite fp16 d / m."""
    from engine.cu.quant import QUANT_FORMATS

    gen = gen or rng
    _, qk, bb = QUANT_FORMATS[fmt]
    b = gen.integers(0, 256, (rows, k // qk, bb), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        v = (gen.standard_normal((rows, k // qk)) * scale).astype(np.float16)
        b[:, :, off : off + 2] = v.view(np.uint8).reshape(rows, k // qk, 2)
    return b.reshape(rows, -1)


def reference(fmt: str, blocks: np.ndarray) -> np.ndarray:
    """gguf's dequantize: float32 [rows, k]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(blocks, GGMLQuantizationType[fmt]), np.float32)


def k_for(fmt: str) -> int:
    return 512 if fmt.endswith("_K") else 576  # SmolLM2's hidden size for the 32-value blocks


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def kern(dev):
    from engine.cu.kernels import Kernels

    k = Kernels(64, 2, formats=FORMATS)
    scratch = dev.mem_alloc(2 * 4096 * 1024)
    k.scratch, k.scratch_bytes = int(scratch), 2 * 4096 * 1024
    yield k
    scratch.free()


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


from tests.kernels.gemv_checks import check_epilogue, check_qkv_rope, rms_norm  # noqa: E402
from tests.kernels.test_cuda_kernels import _live, bf, get, put, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _release():
    yield
    _live.clear()


def matrix(fmt: str, blocks: np.ndarray, k: int):
    from engine.cu.quant import Matrix, Part

    g = put(blocks)
    return Matrix((Part(int(g.ptr), fmt, blocks.shape[0]),), k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_bit_exact(kern, stream, fmt):
    """dequant_q_f32 gives gguf's float32 values bit for bit (signed zeros too); dequant_q_bf16 their
    bf16 rounding."""
    from engine.backends.cuda.weights import to_bf16

    k = k_for(fmt)
    for rows in (1, 37):
        blocks = random_blocks(fmt, rows, k)
        ref = reference(fmt, blocks)
        assert np.isfinite(ref).all()
        g_w = put(blocks)
        g_f = put(np.full((rows, k), np.nan, np.float32))
        g_b = put(np.full((rows, k), 0x7FC0, np.uint16))
        q = kern.quant(fmt)
        q.dequantize(stream, g_w.ptr, g_f.ptr, rows, k, dtype="f32")
        q.dequantize(stream, g_w.ptr, g_b.ptr, rows, k)
        stream.synchronize()
        np.testing.assert_array_equal(get(g_f).reshape(rows, k).view(np.uint32), ref.view(np.uint32))
        np.testing.assert_array_equal(get(g_b).reshape(rows, k), to_bf16(ref).reshape(rows, k))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epi", ["store", "acc", "swiglu", "geglu"])
def test_gemv_epilogues(kern, stream, fmt, epi):
    """Every linear epilogue over ``fmt`` blocks at widths 1, 2, 8 against numpy (float64 over gguf's
    dequantized weights), a row's result bitwise the same at every width (gemv_checks.check_epilogue).
    K fits one stage of the kernel's pipeline; test_gemv_many_stages takes longer rows."""
    from engine.backends.cuda.weights import interleave_gate_up

    k = k_for(fmt)
    n = 200 if epi in ("store", "acc") else 2 * 96  # not a multiple of 16 for store / acc
    blocks = random_blocks(fmt, n, k, scale=0.2 / np.sqrt(k))
    if epi in ("swiglu", "geglu"):
        blocks = interleave_gate_up(blocks[: n // 2], blocks[n // 2 :])  # rows of blocks, as the uploader does
    check_epilogue(kern, stream, epi, matrix(fmt, blocks, k), reference(fmt, blocks), rng, fmt)


# bench/bench_quant.py's other tunings (QKH 0: K-quant scales decoded a unit at a time).
OTHER_TUNINGS = [("Q4_K", (4, 2, 3)), ("Q4_K", (4, 3, 2, 0)), ("Q5_K", (4, 3, 2, 0)), ("Q4_K", (4, 4, 2)),
                 ("Q6_K", (4, 2, 3)), ("Q8_0", (4, 2, 3)), ("Q8_0", (2, 3, 3))]  # fmt: skip


@pytest.mark.parametrize("fmt,tuning", [(f, None) for f in FORMATS] + OTHER_TUNINGS)
def test_gemv_many_stages(kern, stream, fmt, tuning):
    """Rows of more stages than gemv_q.cu keeps in flight (its slots are refilled and their barriers'
    phases flip), a last stage partly filled, 32-value formats with an odd count of blocks (rows not
    16-byte aligned for most of them), a last tile of 8 rows: store and acc against numpy; also at the
    tunings bench/bench_quant.py compares."""
    from engine.cu.kernels import TC_PARAMS
    from engine.cu.quant import DEFAULT_TUNING, QUANT_TUNING, QuantKernels

    tune = tuning or QUANT_TUNING.get(fmt, DEFAULT_TUNING)
    stage = 8 * tune[0] * 64
    k = 7 * stage + (3 * 256 if fmt.endswith("_K") else 96)
    n = 40
    blocks = random_blocks(fmt, n, k, scale=0.2 / np.sqrt(k))
    saved = kern._quant.get(fmt)
    if tuning:
        kern._quant[fmt] = QuantKernels(fmt, TC_PARAMS, tuning=tuning)
    try:
        for epi in ("store", "acc"):
            check_epilogue(kern, stream, epi, matrix(fmt, blocks, k), reference(fmt, blocks), rng, fmt)
    finally:
        kern._quant[fmt] = saved


@pytest.mark.parametrize("fmt", FORMATS)
def test_qkv_rope_two_formats(kern, stream, fmt):
    """The rope + KV-write epilogue over a q|k|v matrix of two parts (q|k in ``fmt``, v in Q6_K or Q8_0, as a
    Q4_K_M file stores it) against numpy at widths 1, 2, 8 (float64 over gguf's dequantized weights); row 0
    bitwise the same at every width (gemv_checks.check_qkv_rope)."""
    k = k_for(fmt)
    vfmt = "Q6_K" if k % 256 == 0 else "Q8_0"

    def product(b_qk, b_v, hres, nw, eps, rows):
        w = np.concatenate([reference(fmt, b_qk), reference(vfmt, b_v)])  # rope-interleaved rows, like the blocks
        return rms_norm(hres[:rows], nw, eps) @ w.T

    check_qkv_rope(kern, stream, fmt, vfmt, k, product, 8e-3, rng)


def _uninterleave(y: np.ndarray, d: int, heads: int) -> np.ndarray:
    """Columns of ``heads`` heads from the rope-interleaved order (weights.interleave_rope) back to natural order."""
    return y.reshape(y.shape[0], heads, d // 16, 2, 8).swapaxes(2, 3).reshape(y.shape[0], -1)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_prefill_dequant_gemm(kern, stream, fmt):
    """Wider than 8 rows a quantized matrix is dequantized into the scratch buffer for the GEMM."""
    k, n, rows = k_for(fmt), 384, 40
    blocks = random_blocks(fmt, n, k, 0.2 / np.sqrt(k))
    w = bf(reference(fmt, blocks))  # the GEMM multiplies bf16(w)
    x = bf(rng.standard_normal((rows, k)).astype(np.float32))
    g_o = put(np.full((rows, n), np.nan, np.float32))
    kern.linear(stream, put(x, True).ptr, matrix(fmt, blocks, k), 0, g_o.ptr, rows, n, k)
    stream.synchronize()
    assert rel_err(get(g_o).reshape(rows, n), x.astype(np.float64) @ w.T) < 1e-4


def blocks_with_std(fmt: str, rows: int, k: int, std: float) -> np.ndarray:
    """Random ``fmt`` rows whose dequantized values have about standard deviation ``std`` (the same
    quants drawn twice, the fp16 scale fields scaled the second time)."""
    seed = int(rng.integers(1 << 30))
    b = random_blocks(fmt, rows, k, 1.0, np.random.default_rng(seed))
    return random_blocks(fmt, rows, k, std / float(reference(fmt, b).std()), np.random.default_rng(seed))


# Per tensor kind: (format of an untied "Q4_K_M-like" model, format of a tied "SmolLM2-like" one).
TINY_FORMATS = {"embed_tokens": ("Q4_K", "Q8_0"), "lm_head": ("Q6_K", None), "q_proj": ("Q4_K", "Q4_0"),
                "k_proj": ("Q4_K", "Q4_0"), "v_proj": ("Q6_K", "Q5_0"), "o_proj": ("Q5_K", "Q5_1"),
                "gate_proj": ("Q4_K", "Q4_1"), "up_proj": ("Q4_K", "Q4_1"), "down_proj": ("Q6_K", "Q8_0")}  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_llama_mixed_formats_match_numpy(dev, tied):
    """A 3-layer llama whose every matrix is kept in blocks (two formats in one q|k|v; a tied LM head on
    the embedding's blocks; the table dequantized on the device) against the numpy backend on the
    same weights dequantized by gguf: prefill logits through the GEMVs (5 tokens) and through the
    dequant + GEMM path (40 tokens), greedy tokens until the first near-tie, widths 1 and 4 alike."""
    from engine.backends import create_backend
    from engine.backends.cuda import CudaBackend
    from engine.loaders.gguf import BLOCK_TYPES, QuantizedTensor
    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.test_cuda_archs import assert_follows
    from tests.kernels.test_cuda_model import _run_lanes, cosine, prefill_logits

    cfg = ModelConfig(arch="llama", vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=3,
                      num_heads=8, num_kv_heads=2, head_dim=64, max_position=4096, tie_word_embeddings=tied)  # fmt: skip
    stored, floats = {}, {}
    for name, shape in definition("llama").tensors(cfg).items():
        if len(shape) == 1:
            floats[name] = stored[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        fmt = TINY_FORMATS[name.split(".")[-2]][int(tied)]
        b = blocks_with_std(fmt, shape[0], shape[1], 1.0 if "embed" in name else shape[1] ** -0.5)
        stored[name] = QuantizedTensor(BLOCK_TYPES[fmt][0], shape, b)
        floats[name] = reference(fmt, b)
    be = CudaBackend()
    be.load(cfg, stored, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
    ref = create_backend("numpy")
    ref.load(cfg, floats, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
    try:
        L0 = be.weights.layers[0]
        assert L0.qkv.formats == (("Q4_0", "Q5_0") if tied else ("Q4_K", "Q6_K"))
        assert be.weights.lm_head.formats == (("Q8_0",) if tied else ("Q6_K",))
        for n in (5, 40):
            ids = rng.integers(0, cfg.vocab_size, n).tolist()
            table = list(range(-(-n // 16)))
            got, want = prefill_logits(be, ids, table), prefill_logits(ref, ids, table)
            assert cosine(got, want) >= 0.999, (n, cosine(got, want))
        prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(5, 30))).tolist() for _ in range(4)]
        tables = [list(range(i * 4, i * 4 + 4)) for i in range(4)]
        toks, lps = {}, {}
        for label, backend, width in [("numpy", ref, 4), ("cuda1", be, 1), ("cuda4", be, 4)]:
            toks[label], lps[label] = _run_lanes(backend, prompts, tables, 12, width)
        assert toks["cuda1"] == toks["cuda4"] and lps["cuda1"] == lps["cuda4"]
        assert_follows(ref, prompts, toks["numpy"], toks["cuda1"])
    finally:
        be.unload()
        ref.unload()


SMOL = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_q4_1_as_stored_matches_numpy(dev):
    """The default model's GGUF on the CUDA backend with its matrices kept as Q4_1 (and the tied head as
    the Q8_0 embedding's blocks): greedy tokens identical to the numpy backend for 32 tokens on 4
    prompts until the first near-tie, the same at widths 1 and 4, and the plan counts stored bytes.
    ``IGNIS_TEST_SMOL_GGUF`` names another copy (a truncation of its first layers, say)."""
    import os

    from engine.backends import create_backend
    from engine.backends.cuda import CudaBackend
    from engine.loaders.gguf import load_gguf
    from tests.conftest import models_dir
    from tests.kernels.test_cuda_archs import assert_follows
    from tests.kernels.test_cuda_model import _run_lanes

    path = Path(os.environ.get("IGNIS_TEST_SMOL_GGUF") or models_dir() / SMOL)
    if not path.exists():
        pytest.skip(f"{path} absent (tests/conftest.py default_gguf_path fetches it)")
    cfg, stored = load_gguf(path, as_stored=CudaBackend.weights_as_stored)
    _, floats = load_gguf(path)
    be = CudaBackend()
    plan = be.load(cfg, stored, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=2048)
    ref = create_backend("numpy")
    ref.load(cfg, floats, block_size=16, kv_budget_bytes=256 << 20, host_kv_budget_bytes=0, max_context=2048)
    try:
        L0 = be.weights.layers[0]
        assert L0.qkv.formats == ("Q4_1",) and L0.gate_up.formats == ("Q4_1",) and L0.down.formats == ("Q4_1",)
        assert be.weights.lm_head.formats == ("Q8_0",)
        # Stored bytes: ~4.5 bits a layer weight, far below the 2 bytes of bf16.
        layer_bytes = sum(m.nbytes for L in be.weights.layers for m in (L.qkv, L.o, L.gate_up, L.down))
        n_layer = sum(m.rows * m.k for L in be.weights.layers for m in (L.qkv, L.o, L.gate_up, L.down))
        assert layer_bytes == n_layer // 32 * 20 and plan.weights_bytes == be.weights.nbytes
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(5, 40))).tolist() for _ in range(4)]
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
        toks = {}
        for label, backend, width in [("numpy", ref, 4), ("cuda1", be, 1), ("cuda4", be, 4)]:
            toks[label], _ = _run_lanes(backend, prompts, tables, 31, width)
        assert toks["cuda1"] == toks["cuda4"]
        assert [len(a) for a in toks["numpy"]] == [32] * 4
        assert_follows(ref, prompts, toks["numpy"], toks["cuda1"])
    finally:
        be.unload()
        ref.unload()
