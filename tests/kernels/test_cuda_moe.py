"""The MoE kernels (engine/cu/moe.cu, moe_gemm.cu) and the expert cache against numpy's
``route`` / ``moe`` on the same bf16-rounded weights. Skipped without PyCUDA and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = requires_cuda
rng = np.random.default_rng(7)


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda


@pytest.fixture(scope="module")
def kern(dev):
    from engine.backends.cuda.moe import MoEKernels

    return MoEKernels()


@pytest.fixture(scope="module")
def stream(dev):
    return dev.Stream()


@pytest.fixture
def mem(dev):
    from engine.cu.runtime import Allocations

    m = Allocations()
    yield m
    m.free()


def bf(a):
    from engine.backends.cuda.weights import from_bf16, to_bf16

    return from_bf16(to_bf16(a)).reshape(np.shape(a))


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) + 1e-30))


def put(mem, a) -> int:
    import pycuda.driver as cuda

    a = np.ascontiguousarray(a)
    p = mem.alloc(a.nbytes)
    cuda.memcpy_htod(p, a)
    return p


def get(p: int, shape, dtype=np.float32):
    import pycuda.driver as cuda

    out = np.empty(shape, dtype)
    cuda.memcpy_dtoh(out, p)
    return out


def config(H=128, inter=64, E=8, k=2, layers=1):
    from engine.model_config import ModelConfig

    return ModelConfig(arch="qwen3_moe", vocab_size=256, hidden_size=H, intermediate_size=4 * H, num_layers=layers,
                       num_heads=2, num_kv_heads=1, head_dim=64, num_experts=E, num_experts_per_tok=k,
                       moe_intermediate_size=inter)  # fmt: skip


def weights(cfg, op, scale=1.0):
    """Random bf16-representable canonical tensors of every MoE layer."""
    H, inter, w = cfg.hidden_size, cfg.moe_intermediate_size, {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp."
        w[p + "gate.weight"] = bf(rng.standard_normal((op.num_experts, H)).astype(np.float32) * scale / np.sqrt(H))
        if op.router_bias:
            w[p + "gate.bias"] = rng.standard_normal(op.num_experts).astype(np.float32) * 0.1
        for e in range(op.num_experts):
            for n, shape in (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter))):
                w[f"{p}experts.{e}.{n}_proj.weight"] = bf(rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1]))  # fmt: skip
                if op.expert_bias:
                    w[f"{p}experts.{e}.{n}_proj.bias"] = rng.standard_normal(shape[0]).astype(np.float32) * 0.1
    return w


def reference(cfg, op, w, i, x):
    from engine.backends.numpy.forward import _Experts
    from engine.backends.numpy.linear import Linear
    from engine.backends.numpy.ops import moe

    p, E = f"model.layers.{i}.mlp.", op.num_experts
    ex = [f"{p}experts.{e}." for e in range(E)]
    b = (lambda n: w.get(n)) if op.expert_bias else (lambda n: None)
    layer = _Experts(
        op=op, router=Linear(w[p + "gate.weight"]), router_bias=w.get(p + "gate.bias") if op.router_bias else None,
        gate_up=[Linear(np.concatenate([w[e + "gate_proj.weight"], w[e + "up_proj.weight"]])) for e in ex],
        gate_up_bias=[None if b(e + "gate_proj.bias") is None else np.concatenate([w[e + "gate_proj.bias"], w[e + "up_proj.bias"]]) for e in ex],  # fmt: skip
        down=[Linear(w[e + "down_proj.weight"]) for e in ex], down_bias=[b(e + "down_proj.bias") for e in ex],
    )  # fmt: skip
    return moe(x, layer)


def build(cfg, op, w, mem, rows, gpu_budget=None):
    from engine.backends.cuda.expert_cache import upload_moe
    from engine.backends.cuda.moe import DeviceMoE, MoEKernels, MoEWorkspace

    layers, cache = upload_moe(cfg, op, w, mem, gpu_budget)
    ws = MoEWorkspace(op.num_experts, op.top_k, cfg.hidden_size, cfg.moe_intermediate_size, rows, mem)
    return DeviceMoE(cfg, op, MoEKernels(), layers, ws, cache)


def run(moe, stream, mem, x, mode="decode", i=0):
    """x + MoE(bf16(x)) from the device."""
    from engine.backends.cuda.weights import to_bf16

    rows, H = x.shape
    gx, gxn = put(mem, x), put(mem, to_bf16(x))
    (moe.decode if mode == "decode" else moe.prefill)(stream, i, gxn, gx, rows)
    stream.synchronize()
    return get(gx, (rows, H))


@pytest.mark.parametrize("E,k,normalize", [(128, 8, True), (8, 2, False), (32, 4, True), (200, 16, False)])
def test_route_matches_numpy_with_ties(kern, stream, mem, E, k, normalize):
    from engine.backends.cuda.moe import MoEWorkspace
    from engine.backends.numpy.ops import route

    M = 37
    logits = rng.standard_normal((M, E)).astype(np.float32)
    logits[0, :] = 1.5  # every expert tied: the lowest ids win
    logits[1, 3] = logits[1, 7] = logits[1, 1] = logits[1].max() + 1  # a three-way tie at the top
    logits[2, ::2] = logits[2, 1]  # many ties in the middle
    ws = MoEWorkspace(E, k, 64, 64, M, mem)
    import pycuda.driver as cuda

    cuda.memcpy_htod(ws.logits, logits)
    kern.route(stream, (1,), logits=ws.logits, M=M, E=E, k=k, normalize=int(normalize), ids=ws.ids,
               weights=ws.weights, grp=ws.grp, tmax=ws.tmax)  # fmt: skip
    stream.synchronize()
    ids, wts = route(logits, k, normalize)
    np.testing.assert_array_equal(get(ws.ids, (M, k), np.int32), ids)
    np.testing.assert_allclose(get(ws.weights, (M, k)), wts, rtol=2e-6, atol=1e-7)
    # The groups table: active experts ascending, each group's pairs exactly the pairs choosing it.
    g = get(ws.grp, 3 + 2 * E + 3 * ws.tmax + M * k, np.int32)
    n = g[0]
    active, off = g[2 : 2 + n], g[2 + E : 3 + E + n]
    pairs = g[3 + 2 * E + 3 * ws.tmax :]
    np.testing.assert_array_equal(active, np.unique(ids))
    for j, e in enumerate(active):
        np.testing.assert_array_equal(np.sort(pairs[off[j] : off[j + 1]]), np.flatnonzero(ids.reshape(-1) == e))


@pytest.mark.parametrize("act,bias", [("silu", False), ("swiglu_oai", True)])
def test_decode_matches_numpy_widths_1_to_8(stream, mem, act, bias):
    from engine.models.ops import MoE

    cfg = config(H=256, inter=128, E=16, k=4)
    op = MoE(16, 4, norm_topk_prob=act == "silu", router_bias=bias, expert_bias=bias, act=act,
             swiglu_limit=7.0 if act == "swiglu_oai" else None)  # fmt: skip
    w = weights(cfg, op, scale=4.0)
    moe = build(cfg, op, w, mem, 8)
    for rows in range(1, 9):
        x = bf(rng.standard_normal((rows, 256)).astype(np.float32))
        got = run(moe, stream, mem, x) - x
        assert rel_err(got, reference(cfg, op, w, 0, x)) < 6e-3, rows


def test_decode_fused_rmsnorm_and_norm_out(stream, mem):
    """ss_in scales each row by its RMSNorm (xn = bf16(h * w)); norm_out writes the next norm's inputs."""
    from engine.backends.cuda.weights import from_bf16, to_bf16
    from engine.models.ops import MoE

    cfg, op = config(), MoE(8, 2)
    w = weights(cfg, op, scale=4.0)
    moe = build(cfg, op, w, mem, 8)
    rows, H, eps = 5, cfg.hidden_size, 1e-6
    h = rng.standard_normal((rows, H)).astype(np.float32) * 3
    nw = bf(rng.standard_normal(H).astype(np.float32))
    nxt = bf(rng.standard_normal(H).astype(np.float32))
    ss = (h.reshape(rows, 4, -1) ** 2).sum(-1).astype(np.float32)  # 4 partials a row
    gx, gxn, gss = put(mem, h), put(mem, to_bf16(h * nw)), put(mem, ss)
    gw, gout, gss_out = put(mem, to_bf16(nxt)), put(mem, np.zeros((rows, H), np.uint16)), put(mem, np.zeros(64, np.float32))  # fmt: skip
    nparts = moe.decode(stream, 0, gxn, gx, rows, ss_in=(gss, 4), eps=eps, norm_out=(gw, gout, gss_out))
    stream.synchronize()
    xn = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * nw
    ref = h + reference(cfg, op, w, 0, xn)
    got = get(gx, (rows, H))
    assert rel_err(got - h, ref - h) < 1e-2
    assert nparts == -(-H // 128)
    np.testing.assert_allclose(get(gss_out, (rows, nparts)).sum(-1), (got * got).sum(-1), rtol=1e-5)
    assert rel_err(from_bf16(get(gout, (rows, H), np.uint16)), got * nxt) < 5e-3


def test_decode_row_independent_of_round_width(stream, mem):
    """A row's output is bitwise the same whatever else shares its round (widths 1..64)."""
    from engine.models.ops import MoE

    cfg, op = config(H=256, inter=128, E=32, k=8), MoE(32, 8)
    moe = build(cfg, op, weights(cfg, op, scale=4.0), mem, 64)
    x = bf(rng.standard_normal((64, 256)).astype(np.float32))
    full = run(moe, stream, mem, x)
    for width in (1, 2, 3, 5, 8, 17, 64):
        np.testing.assert_array_equal(run(moe, stream, mem, x[:width]), full[:width])
    single = np.concatenate([run(moe, stream, mem, x[r : r + 1]) for r in range(0, 64, 9)])
    np.testing.assert_array_equal(single, full[::9])


@pytest.mark.parametrize("rows,E,k,bias", [(600, 8, 2, False), (130, 32, 4, True), (3, 16, 4, False)])
def test_prefill_grouped_gemm_matches_numpy(stream, mem, rows, E, k, bias):
    from engine.models.ops import MoE

    cfg = config(H=128, inter=64, E=E, k=k)
    act = "swiglu_oai" if bias else "silu"
    op = MoE(E, k, router_bias=bias, expert_bias=bias, act=act, swiglu_limit=7.0 if bias else None)
    w = weights(cfg, op, scale=4.0)
    moe = build(cfg, op, w, mem, rows)
    x = bf(rng.standard_normal((rows, 128)).astype(np.float32))
    got = run(moe, stream, mem, x, mode="prefill") - x
    assert rel_err(got, reference(cfg, op, w, 0, x)) < 6e-3


def test_expert_cache_half_resident_matches_resident(stream, mem):
    from engine.backends.cuda.expert_cache import expert_nbytes
    from engine.models.ops import MoE

    cfg, op = config(E=8, k=2, layers=3), MoE(8, 2)
    w = weights(cfg, op, scale=4.0)
    full = build(cfg, op, w, mem, 8)
    half = build(cfg, op, w, mem, 8, gpu_budget=12 * expert_nbytes(cfg))
    assert full.cache is None and half.cache.resident == 12 and not half.graph_safe
    for rnd in range(6):
        x = bf(rng.standard_normal((1 + rnd, 128)).astype(np.float32))
        for mode in ("decode", "prefill"):
            for i in range(3):
                np.testing.assert_array_equal(run(half, stream, mem, x, mode, i), run(full, stream, mem, x, mode, i))
    assert half.cache.misses > 0 and half.cache.hits > 0


def test_expert_cache_counters_on_scripted_routing(stream, mem):
    """Zero router weights, routing by the router bias: a scripted sequence with known hits and misses."""
    import pycuda.driver as cuda

    from engine.backends.cuda.expert_cache import expert_nbytes
    from engine.models.ops import MoE

    cfg, op = config(E=8, k=2, layers=2), MoE(8, 2, router_bias=True)
    w = weights(cfg, op)
    for i in range(2):
        w[f"model.layers.{i}.mlp.gate.weight"][:] = 0
    moe = build(cfg, op, w, mem, 8, gpu_budget=8 * expert_nbytes(cfg))  # layer 0: experts 0-3, layer 1: 0-3
    c = moe.cache
    assert c.resident == 8 and c.hits == c.misses == c.bytes_moved == 0

    def rnd(i, chosen):
        b = np.zeros(8, np.float32)
        b[list(chosen)] = [10.0, 9.0]
        cuda.memcpy_htod(moe.layers[i].router_bias, b)
        run(moe, stream, mem, bf(rng.standard_normal((2, 128)).astype(np.float32)), "decode", i)  # both rows alike

    rnd(0, (1, 0))  # 2 hits
    rnd(1, (4, 5))  # 2 misses, evicting layer 0's experts 2 and 3 (least recently used)
    assert (c.hits, c.misses) == (2, 2)
    rnd(0, (2, 0))  # 0 a hit, 2 a miss (evicted above)
    assert (c.hits, c.misses) == (3, 3)
    rnd(1, (5, 4))  # 2 hits
    assert (c.hits, c.misses, c.bytes_moved) == (5, 3, 3 * expert_nbytes(cfg))
    assert c.table[0, 2] >= 0 and c.table[0, 3] == -1 and c.resident == 8
