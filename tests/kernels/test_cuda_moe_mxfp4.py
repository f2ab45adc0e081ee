"""MXFP4 experts kept as stored (engine/cu/mxfp4.py, moe_gemv.cu's ``MOE_MX`` build) against the same
experts dequantized: the bf16 kernels on those values (exact in bf16), numpy's ``moe``, and a tiny
MXFP4 gpt-oss checkpoint served by the CUDA backend against the numpy backend. Skipped without
PyCUDA and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cuda.moe import MX_PREFILL_AS_DECODE, MX_PREFILL_TILES
from tests.kernels.gpu import requires_cuda
from tests.kernels.test_cuda_moe import bf, config, get, put, reference, rel_err, run, weights
from tests.kernels.test_cuda_moe import build as build_bf16

pytestmark = requires_cuda
rng = np.random.default_rng(11)


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


@pytest.fixture
def mem(dev):
    from engine.cu.runtime import Allocations

    m = Allocations()
    yield m
    m.free()


def mx_tensor(rows: int, cols: int, scales=(119, 124)):
    from engine.loaders.mxfp4 import Mxfp4Tensor

    g = cols // 32
    return Mxfp4Tensor(rng.integers(0, 256, (rows, g, 16), dtype=np.uint8),
                       rng.integers(*scales, (rows, g), dtype=np.uint8))  # fmt: skip


def mx_weights(cfg, op):
    """``weights`` with every expert matrix an ``Mxfp4Tensor`` (random codes, scales 2^-8 .. 2^-4)."""
    w = weights(cfg, op, scale=4.0)
    for name in [n for n in w if ".experts." in n and n.endswith("_proj.weight")]:
        w[name] = mx_tensor(*w[name].shape)
    return w


def dense(w):
    """The same weights with the experts dequantized (float32, each value exact in bf16)."""
    from engine.loaders.mxfp4 import Mxfp4Tensor

    return {n: t.dequantize() if isinstance(t, Mxfp4Tensor) else t for n, t in w.items()}


# moe_gemv.cu's MXFP4 builds: the default (moe.MX_DEFINES: the down GEMV as 16-row blocks with K split over
# the warps, a row group in flight), and the first build (a warp walks all of K for its down rows, two in flight)
VARIANTS = {"default": (), "unsplit_down": (("MX_U", 2), ("MX_DOWN_SPLIT", 0))}


def build(cfg, op, w, mem, rows, gpu_budget=None, variant="default", tiles=None):
    """``tiles``: long prefill chunks through the GEMMs reading MXFP4 tiles, else the bf16 scratch (None:
    the backend's default, ``MX_PREFILL_TILES``)."""
    tiles = MX_PREFILL_TILES if tiles is None else tiles
    from engine.backends.cuda.expert_cache import upload_moe
    from engine.backends.cuda.moe import DeviceMoE, MoEKernels, MoEWorkspace

    kern = MoEKernels(mx=True, mx_defines=VARIANTS[variant], mx_tiles=tiles)
    layers, cache = upload_moe(cfg, op, w, mem, gpu_budget, kern=kern)
    ws = MoEWorkspace(op.num_experts, op.top_k, cfg.hidden_size, cfg.moe_intermediate_size, rows, mem, mx=True,
                      scratch=not tiles)  # fmt: skip
    assert bool(ws.mx_scratch) == (not tiles)
    moe = DeviceMoE(cfg, op, kern, layers, ws, cache)
    assert moe.mx
    return moe


def op_for(act: str, E: int, k: int):
    from engine.models.ops import MoE

    bias = act == "swiglu_oai"
    return MoE(E, k, norm_topk_prob=True, router_bias=bias, expert_bias=bias, act=act,
               swiglu_limit=7.0 if bias else None)  # fmt: skip


@pytest.mark.parametrize("scales", [(119, 124), (0, 8), (120, 160)])
def test_dequant_kernel_is_the_blob_exactly(stream, mem, scales):
    """moe_mx_dequant gives each expert's values exactly (mxfp4.unpack), K not a multiple of 128."""
    from engine.backends.cuda.moe import MOE_THREADS, MoEKernels
    from engine.backends.cuda.weights import to_bf16
    from engine.cu import mxfp4

    E, N, K = 3, 40, 288
    ts = [mx_tensor(N, K, scales) for _ in range(E)]
    blobs = np.stack([mxfp4.pack(t.blocks, t.scales) for t in ts])
    slot_of = np.array([2, 0, 1], np.int32)  # expert e's blob in slot slot_of[e]
    pool = put(mem, blobs[np.argsort(slot_of)])
    out = mem.alloc(E * N * K * 2)
    kern = MoEKernels(mx=True)
    words = N * mxfp4.padded_k(K) // 8
    kern.mx_dequant(stream, (-(-words // MOE_THREADS), E), pool=pool, stride=blobs.shape[1], slot_of=put(mem, slot_of),
                    N=N, K=K, out=out)  # fmt: skip
    stream.synchronize()
    got = get(out, (E, N, K), np.uint16)
    for e, t in enumerate(ts):
        np.testing.assert_array_equal(got[e], to_bf16(t.dequantize()))


@pytest.mark.parametrize("H,inter", [(256, 128), (288, 96), (2880, 64)])
def test_pack_kernel_writes_the_blobs(stream, mem, H, inter):
    """upload_moe's blobs (packed on the card) are mxfp4.pack's of the bf16 pools' rows (the bytes a blob
    defines: its alignment padding is never written nor read, so it holds whatever the pool's memory held)."""
    from engine.backends.cuda.expert_cache import expert_bytes, upload_moe
    from engine.backends.cuda.moe import MoEKernels
    from engine.backends.cuda.weights import interleave_gate_up
    from engine.cu import mxfp4
    from engine.loaders.mxfp4 import Mxfp4Tensor

    cfg, op = config(H=H, inter=inter, E=3, k=2), op_for("silu", 3, 2)
    w = mx_weights(cfg, op)
    (layer,), _ = upload_moe(cfg, op, w, mem, kern=MoEKernels(mx=True))
    gu_bytes, down_bytes = expert_bytes(cfg, mx=True)
    rows = interleave_gate_up(*np.arange(2 * inter).reshape(2, -1, 1))[:, 0]
    got_gu, got_down = get(layer.gu_pool, (3, gu_bytes), np.uint8), get(layer.down_pool, (3, down_bytes), np.uint8)
    for e in range(3):
        g, u, d = (w[f"model.layers.0.mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        gu = Mxfp4Tensor(np.concatenate([g.blocks, u.blocks]), np.concatenate([g.scales, u.scales])).rows(rows)
        for got, blob, (n, k) in ((got_gu[e], mxfp4.pack(gu.blocks, gu.scales), (2 * inter, H)),
                                  (got_down[e], mxfp4.pack(d.blocks, d.scales), (H, inter))):  # fmt: skip
            used = n * mxfp4.padded_k(k) // 2 + n * mxfp4.padded_k(k) // 32
            np.testing.assert_array_equal(got[:used], blob[:used])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act,H,inter", [("silu", 256, 128), ("swiglu_oai", 288, 96)])
def test_decode_matches_bf16_kernels_and_numpy(stream, mem, act, H, inter, variant):
    cfg, op = config(H=H, inter=inter, E=16, k=4), op_for(act, 16, 4)
    w = mx_weights(cfg, op)
    moe, ref = build(cfg, op, w, mem, 64, variant=variant), build_bf16(cfg, op, dense(w), mem, 64)
    for rows in (1, 2, 5, 8, 17, 64):
        x = bf(rng.standard_normal((rows, H)).astype(np.float32))
        got = run(moe, stream, mem, x) - x
        assert rel_err(got, run(ref, stream, mem, x) - x) < 2e-3, rows
        assert rel_err(got, reference(cfg, op, dense(w), 0, x)) < 6e-3, rows


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_next_norms_inputs_match_bf16_kernels(stream, mem, variant):
    """norm_out: the combine's next-RMSNorm inputs (xw and the ss partials, one a 128-column tile)."""
    from engine.backends.cuda.weights import from_bf16, to_bf16

    cfg, op = config(H=288, inter=96, E=8, k=2), op_for("silu", 8, 2)
    w = mx_weights(cfg, op)
    rows, H = 5, 288
    h = rng.standard_normal((rows, H)).astype(np.float32)
    nxt = put(mem, to_bf16(bf(rng.standard_normal(H).astype(np.float32))))
    outs = []
    for moe in (build(cfg, op, w, mem, 8, variant=variant), build_bf16(cfg, op, dense(w), mem, 8)):
        gx, gxn, gxw, gss = put(mem, h), put(mem, to_bf16(h)), mem.alloc(rows * H * 2), mem.alloc(rows * 64 * 4)
        nparts = moe.decode(stream, 0, gxn, gx, rows, norm_out=(nxt, gxw, gss))
        stream.synchronize()
        assert nparts == 3
        outs.append((get(gx, (rows, H)), from_bf16(get(gxw, (rows, H), np.uint16)), get(gss, (rows, nparts))))
    (x, xw, ss), (x_ref, xw_ref, ss_ref) = outs
    assert rel_err(x - h, x_ref - h) < 2e-3 and rel_err(xw, xw_ref) < 5e-3
    np.testing.assert_allclose(ss.sum(-1), (x * x).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(ss, ss_ref, rtol=5e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_row_independent_of_round_width(stream, mem, variant):
    cfg, op = config(H=256, inter=128, E=32, k=8), op_for("silu", 32, 8)
    moe = build(cfg, op, mx_weights(cfg, op), mem, 64, variant=variant)
    x = bf(rng.standard_normal((64, 256)).astype(np.float32))
    full = run(moe, stream, mem, x)
    for width in (1, 3, 8, 17, 64):
        np.testing.assert_array_equal(run(moe, stream, mem, x[:width]), full[:width])


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "scratch"])
@pytest.mark.parametrize("rows,act,H", [(300, "silu", 288), (37, "swiglu_oai", 288), (200, "swiglu_oai", 416)])
def test_prefill_is_the_bf16_prefill_bitwise(stream, mem, rows, act, H, tiles):
    """A chunk past ``prefill_as_decode`` turns each k-tile's blocks into bf16 in shared memory (tiles) or
    dequantizes into the scratch, both exact, so it is the bf16 pools' GEMM on the same values (37 rows:
    the threshold lowered to reach that path; H 288 and 416: K not a multiple of 128, N past a tile)."""
    cfg, op = config(H=H, inter=96, E=8, k=2), op_for(act, 8, 2)
    w = mx_weights(cfg, op)
    moe, ref = build(cfg, op, w, mem, rows, tiles=tiles), build_bf16(cfg, op, dense(w), mem, rows)
    assert moe.prefill_as_decode == MX_PREFILL_AS_DECODE and ref.prefill_as_decode == 0
    moe.prefill_as_decode = min(moe.prefill_as_decode, rows - 1)
    x = bf(rng.standard_normal((rows, H)).astype(np.float32))
    np.testing.assert_array_equal(run(moe, stream, mem, x, "prefill"), run(ref, stream, mem, x, "prefill"))


@pytest.mark.parametrize("rows", [1, 16, MX_PREFILL_AS_DECODE])
def test_short_prefill_runs_the_decode_kernels(stream, mem, rows):
    """A chunk of up to ``prefill_as_decode`` rows is the decode round's result bitwise, and still
    within bf16's error of the scratch path's GEMM."""
    cfg, op = config(H=288, inter=96, E=8, k=2), op_for("swiglu_oai", 8, 2)
    moe = build(cfg, op, mx_weights(cfg, op), mem, rows)
    x = bf(rng.standard_normal((rows, 288)).astype(np.float32))
    short = run(moe, stream, mem, x, "prefill")
    np.testing.assert_array_equal(short, run(moe, stream, mem, x))
    moe.prefill_as_decode = 0
    assert rel_err(short - x, run(moe, stream, mem, x, "prefill") - x) < 2e-3


def test_expert_cache_of_mxfp4_blobs_matches_resident(stream, mem):
    from engine.backends.cuda.expert_cache import expert_nbytes

    cfg, op = config(E=8, k=2, layers=3), op_for("silu", 8, 2)
    w = mx_weights(cfg, op)
    full = build(cfg, op, w, mem, 8)
    half = build(cfg, op, w, mem, 8, gpu_budget=12 * expert_nbytes(cfg, mx=True))
    assert full.cache is None and half.cache.resident == 12
    assert expert_nbytes(cfg, mx=True) * 2.5 < expert_nbytes(cfg)  # 17 bytes a 32 values, padded to 256
    for rnd in range(4):
        x = bf(rng.standard_normal((1 + rnd, 128)).astype(np.float32))
        full.prefill_as_decode = half.prefill_as_decode = 0 if rnd % 2 else MX_PREFILL_AS_DECODE  # both paths
        for mode in ("decode", "prefill"):
            for i in range(3):
                np.testing.assert_array_equal(run(half, stream, mem, x, mode, i), run(full, stream, mem, x, mode, i))
    assert half.cache.misses > 0


@pytest.mark.slow
@pytest.mark.parametrize("artifact", ["safetensors", "gguf"])
def test_tiny_mxfp4_gpt_oss_served_as_stored_matches_numpy(tmp_path, artifact):
    """A gpt-oss checkpoint with MXFP4 experts (Hugging Face's, or llama.cpp's GGUF of it): the CUDA
    backend keeps them as stored (a quarter of bf16's bytes) and its prefill logits and greedy
    tokens follow the numpy backend's (float32)."""
    from engine.backends import create_backend
    from engine.backends.cuda.backend import CudaBackend
    from engine.loaders import load_artifact
    from tests.kernels.test_cuda_archs import assert_follows
    from tests.kernels.test_cuda_hf_archs import DIMS
    from tests.kernels.test_cuda_model import _run_lanes, cosine, prefill_logits
    from tests.models.tiny_gpt_oss import quantize_experts_mxfp4, write_checkpoint, write_gguf

    hf = tmp_path / "hf"
    write_checkpoint(hf, **{**DIMS, "intermediate_size": 128, "swiglu_limit": 7.0})
    quantize_experts_mxfp4(hf, scales=(119, 123))
    path = hf
    if artifact == "gguf":
        path = tmp_path / "tiny.gguf"
        write_gguf(hf, path, mxfp4=True)
    cfg, stored = load_artifact(path, mxfp4_as_stored=True, as_stored=CudaBackend.weights_as_stored)
    _, floats = load_artifact(path)
    be = create_backend("cuda")
    plan = be.load(cfg, stored, block_size=16, kv_budget_bytes=256 << 20, host_kv_budget_bytes=0, max_context=1024)
    ref = create_backend("numpy")
    ref.load(cfg, floats, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
    try:
        assert be.moe.mx
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        assert plan.weights_bytes < (be.weights.nbytes + cfg.num_layers * E * 3 * H * inter * 2)
        rng2 = np.random.default_rng(3)
        for n in (5, 40):
            ids = rng2.integers(0, cfg.vocab_size, n).tolist()
            got = prefill_logits(be, ids, list(range(-(-n // 16))))
            want = prefill_logits(ref, ids, list(range(-(-n // 16))))
            assert cosine(got, want) >= 0.999, (n, cosine(got, want))
        prompts = [rng2.integers(0, cfg.vocab_size, int(rng2.integers(8, 40))).tolist() for _ in range(4)]
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
        (cuda_toks, _), (np_toks, _) = _run_lanes(be, prompts, tables, 12, 4), _run_lanes(ref, prompts, tables, 12, 4)
        assert_follows(ref, prompts, np_toks, cuda_toks)
    finally:
        be.unload()
        ref.unload()
