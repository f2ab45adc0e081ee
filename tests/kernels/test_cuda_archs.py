"""The CUDA backend on whole tiny models of the new block kinds, against the numpy backend.

Each model is a test-only definition (a llama with its blocks replaced, registered for the
test) and random bf16-exact weights: qwen3-like QKNorm; gemma2-like (head_dim 256, (1 + w) norms,
post-norms, GeGLU, query scale, attention and final soft-caps, embedding scale and
alternating sliding windows); gemma3-like alternating local / global rope bases with
QKNorm (1 + w); gpt-oss-like sinks, o and qkv biases and alternating windows; phi-like
partial rotary with an attention factor; and an all-sliding (mistral-like) model whose
block tables have the pages behind the window released (-1). Checked: last-position
logits within cosine 0.999 of numpy over whole and chunked prefills, greedy
continuations identical to numpy until the first near-tie, and a lane's tokens and
logprobs bitwise the same at decode widths 1, 3 and 8. Skipped without a device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]

from engine.model_config import ModelConfig  # noqa: E402
from engine.models import DEFINITIONS  # noqa: E402
from engine.models.llama import Llama  # noqa: E402
from engine.models.ops import Attention, Block, Embedding, GatedMLP, Head, MoE, QKNorm, RMSNorm, Rope  # noqa: E402


@dataclass(frozen=True)
class Synthetic(Llama):
    """A llama whose blocks, embedding and head are given (``make_block(cfg, layer)``)."""

    make_block: Callable = field(default=None, compare=False, repr=False)
    embedding_op: Embedding = Embedding()
    head_op: Head = Head()

    def block(self, cfg, layer):
        return self.make_block(cfg, layer)

    def embedding(self, cfg):
        return self.embedding_op

    def head(self, cfg):
        return self.head_op

    def tensors(self, cfg):
        out = super().tensors(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        for i in range(cfg.num_layers):
            b, p = self.block(cfg, i), f"model.layers.{i}."
            for op in (b.attn_post_norm, b.mlp_post_norm):
                if op is not None:
                    out[p + op.weight + ".weight"] = (h,)
            qk = b.attention.qk_norm
            if qk is not None:
                out[p + qk.q_weight + ".weight"] = out[p + qk.k_weight + ".weight"] = (d,)
            if b.attention.o_bias:
                out[p + "self_attn.o_proj.bias"] = (h,)
            if b.attention.sinks:
                out[p + "self_attn.sinks"] = (cfg.num_heads,)
            if isinstance(b.mlp, MoE):
                for n in ("gate_proj", "up_proj", "down_proj"):
                    del out[p + f"mlp.{n}.weight"]
                i_moe, op = cfg.moe_intermediate_size, b.mlp
                out[p + "mlp.gate.weight"] = (op.num_experts, h)
                if op.router_bias:
                    out[p + "mlp.gate.bias"] = (op.num_experts,)
                for e in range(op.num_experts):
                    x = p + f"mlp.experts.{e}."
                    out[x + "gate_proj.weight"] = out[x + "up_proj.weight"] = (i_moe, h)
                    out[x + "down_proj.weight"] = (h, i_moe)
                    if op.expert_bias:
                        out[x + "gate_proj.bias"] = out[x + "up_proj.bias"] = (i_moe,)
                        out[x + "down_proj.bias"] = (h,)
        return out


def _cfg(name, **kw) -> ModelConfig:
    base = dict(arch=name, vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, max_position=4096,
                tie_word_embeddings=True)  # fmt: skip
    return ModelConfig(**{**base, **kw})


G1 = RMSNorm("input_layernorm", plus_one=True)
G2 = RMSNorm("post_attention_layernorm", plus_one=True)
GEMMA_POST = dict(attn_post_norm=RMSNorm("post_attn_norm", True), mlp_post_norm=RMSNorm("post_mlp_norm", True))


def qwen3_block(cfg, i):
    return Block(RMSNorm("input_layernorm"), Attention(Rope(theta=1e6), qk_norm=QKNorm()),
                 RMSNorm("post_attention_layernorm"), GatedMLP())  # fmt: skip


def gemma2_block(cfg, i):
    # query_pre_attn_scalar 224 (gemma sets about head_dim): with head_dim 256 a much larger scale
    # (48^-0.5) makes these random scores so sharp that bf16 q and k alone cost the 0.999 cosine
    # (the numpy reference with bf16 rounding emulated at the backend's points: 0.9987).
    attn = Attention(scale=224**-0.5, softcap=50.0, sliding_window=24 if i % 2 == 0 else None)
    return Block(G1, attn, G2, GatedMLP("gelu_tanh"), **GEMMA_POST)


def gemma3_block(cfg, i):
    local = i % 3 != 2
    rope = Rope(theta=10000.0, scaled=False) if local else Rope(theta=1e6)
    attn = Attention(rope, qk_norm=QKNorm(plus_one=True), scale=0.1, sliding_window=32 if local else None)
    return Block(G1, attn, G2, GatedMLP("gelu_tanh"), **GEMMA_POST)


def gptoss_block(cfg, i):
    attn = Attention(qkv_bias=True, o_bias=True, sinks=True, sliding_window=16 if i % 2 == 0 else None)
    return Block(RMSNorm("input_layernorm"), attn, RMSNorm("post_attention_layernorm"), GatedMLP())


def phi_block(cfg, i):
    return Block(RMSNorm("input_layernorm"), Attention(Rope(rotary_dim=32)), RMSNorm("post_attention_layernorm"),
                 GatedMLP())  # fmt: skip


def qwen3_moe_block(cfg, i):
    return Block(RMSNorm("input_layernorm"), Attention(Rope(theta=1e6), qk_norm=QKNorm()),
                 RMSNorm("post_attention_layernorm"), MoE(num_experts=8, top_k=2, norm_topk_prob=True))  # fmt: skip


def gptoss_moe_block(cfg, i):
    attn = Attention(qkv_bias=True, o_bias=True, sinks=True, sliding_window=16 if i % 2 == 0 else None)
    moe = MoE(num_experts=8, top_k=4, router_bias=True, expert_bias=True, act="swiglu_oai", swiglu_limit=7.0)
    return Block(RMSNorm("input_layernorm"), attn, RMSNorm("post_attention_layernorm"), moe)


MOE_CFG = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)


def sliding_block(cfg, i):
    return Block(RMSNorm("input_layernorm"), Attention(sliding_window=40), RMSNorm("post_attention_layernorm"),
                 GatedMLP())  # fmt: skip


MODELS = {
    "qwen3": (qwen3_block, {}, {}),
    "gemma2": (gemma2_block, dict(embedding_op=Embedding(16.0), head_op=Head(RMSNorm("model.norm", True), 30.0)),
               dict(head_dim=256, num_heads=2, num_kv_heads=1)),
    "gemma3": (gemma3_block, dict(embedding_op=Embedding(16.0), head_op=Head(RMSNorm("model.norm", True))),
               dict(rope_scaling={"rope_type": "linear", "factor": 8.0}, num_layers=3)),
    "gpt_oss": (gptoss_block, {}, dict(attention_bias=True, num_heads=8, head_dim=64, tie_word_embeddings=False)),
    "phi": (phi_block, {}, dict(head_dim=128, num_heads=2, num_kv_heads=1)),
    "sliding": (sliding_block, {}, {}),
    "qwen3_moe": (qwen3_moe_block, {}, MOE_CFG),
    "gpt_oss_moe": (gptoss_moe_block, {}, dict(MOE_CFG, num_experts_per_tok=4, attention_bias=True)),
    # The same model with room on the card for 10 of its 32 experts: the rest come from pinned host RAM.
    "moe_cached": (gptoss_moe_block, {}, dict(MOE_CFG, num_experts_per_tok=4, attention_bias=True)),
}  # fmt: skip
EXPERT_BYTES = 3 * 128 * 256 * 2  # one expert's bf16 gate, up and down at MOE_CFG's shape


def bf(a):
    from engine.backends.cuda.weights import from_bf16, to_bf16

    return from_bf16(to_bf16(a)).reshape(np.shape(a))


def random_weights(d, cfg, seed=0) -> dict[str, np.ndarray]:
    """bf16-exact weights; a (1 + w) norm's 1 + w is bf16-exact too, so both backends scale alike."""
    rng = np.random.default_rng(seed)
    plus_one = set()
    for i in range(cfg.num_layers):
        b = d.block(cfg, i)
        ops = [b.attn_norm, b.mlp_norm, b.attn_post_norm, b.mlp_post_norm]
        if b.attention.qk_norm is not None:
            qk = b.attention.qk_norm
            ops += [RMSNorm(qk.q_weight, qk.plus_one), RMSNorm(qk.k_weight, qk.plus_one)]
        plus_one |= {f"model.layers.{i}.{op.weight}.weight" for op in ops if op is not None and op.plus_one}
    if d.head(cfg).final_norm.plus_one:
        plus_one.add("model.norm.weight")
    out = {}
    for name, shape in d.tensors(cfg).items():
        if len(shape) == 2:
            w = rng.standard_normal(shape) / math.sqrt(shape[1]) * (1.0 if "embed" in name else 1.5)
        elif name.endswith("sinks"):
            w = rng.standard_normal(shape) * 1.5
        elif name.endswith(".bias"):
            w = rng.standard_normal(shape) * 0.3
        else:  # a norm weight
            w = 1 + 0.2 * rng.standard_normal(shape)
            if name in plus_one:
                w = bf(w.astype(np.float32)) - 1
        out[name] = bf(np.asarray(w, np.float32)).astype(np.float32)
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    from engine.backends import create_backend

    kind = request.param
    make, extra, cfg_kw = MODELS[kind]
    name = f"test_cuda_{kind}"
    d = Synthetic(name, (), (), make_block=make, **extra)
    mp = pytest.MonkeyPatch()  # undone when this model's tests are done
    mp.setitem(DEFINITIONS, name, d)
    if kind == "phi":  # a rope attention factor (longrope / yarn give one): 1.25 on cos and sin
        import engine.backends.numpy.forward as npf
        import engine.models.rope as rope_mod

        real = rope_mod.rope_tables

        def with_factor(cfg, rope):
            return real(cfg, rope)[0], 1.25

        mp.setattr(rope_mod, "rope_tables", with_factor)
        mp.setattr(npf, "rope_tables", with_factor)
    cfg = _cfg(name, **cfg_kw)
    weights = random_weights(d, cfg)
    ref = create_backend("numpy")
    ref.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
    if kind == "moe_cached":
        from engine.backends.cuda import CudaBackend
        from engine.config import CudaTuning

        be = CudaBackend(CudaTuning(expert_budget=10 * EXPERT_BYTES))
    else:
        be = create_backend("cuda")
    be.load(cfg, weights, block_size=16, kv_budget_bytes=256 << 20, host_kv_budget_bytes=0, max_context=1024)
    if kind == "moe_cached":
        assert be.moe.cache is not None and not be.moe.graph_safe
    yield kind, cfg, ref, be
    if kind == "moe_cached":
        assert be.moe.cache.misses > 0 and be.moe.cache.hits > 0  # the cache was exercised both ways
        experts = be.stats()["experts"]  # what status and /metrics report
        assert experts["resident"] == 10 and experts["total"] == 32 and experts["bytes_moved"] > 0
    be.unload()
    ref.unload()
    mp.undo()


def test_prefill_logits_match_numpy(model):
    from tests.kernels.test_cuda_model import cosine, prefill_logits

    kind, cfg, ref, be = model
    rng = np.random.default_rng(1)
    for n, chunks in [(1, 1), (37, 1), (150, 1), (150, 4), (300, 3)]:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        table = list(range(-(-n // 16)))
        want = prefill_logits(ref, ids, table, chunks=1)
        got = prefill_logits(be, ids, table, chunks=chunks)
        assert np.isfinite(got).all(), (kind, n, chunks)
        assert cosine(got, want) >= 0.999, (kind, n, chunks, cosine(got, want))
        if kind == "gemma2":  # the final soft-cap holds
            assert np.abs(got).max() <= 30.0 + 1e-3


def test_greedy_matches_numpy_and_is_width_invariant(model):
    from tests.kernels.test_cuda_model import _run_lanes

    kind, cfg, ref, be = model
    rng = np.random.default_rng(2)
    lanes = 8
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(5, 60))).tolist() for _ in range(lanes)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(lanes)]
    steps = 14
    toks, lps = {}, {}
    for label, backend, width in [("numpy", ref, lanes), ("cuda1", be, 1), ("cuda8", be, 8), ("cuda3", be, 3)]:
        toks[label], lps[label] = _run_lanes(backend, prompts, tables, steps, width)
    assert toks["cuda1"] == toks["cuda8"] == toks["cuda3"], kind
    assert lps["cuda1"] == lps["cuda8"] == lps["cuda3"], kind
    assert_follows(ref, prompts, toks["numpy"][:lanes], toks["cuda1"][:lanes], f"{kind}: ")


def assert_follows(ref, prompts: list, want: list, got: list, label: str = "") -> None:
    """Each lane's greedy tokens ``got`` are the reference's ``want`` up to their first difference,
    and that one is at a near tie (``near_tie``, the reference backend ``ref``'s view)."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            j = next(k for k in range(len(a)) if a[k] != b[k])
            assert near_tie(ref, prompts[i] + a[:j]), f"{label}lane {i} diverged at {j}"


def near_tie(ref, seq: list[int]) -> bool:
    """Whether the next token after ``seq`` hangs on a rounding (the numpy reference's view): its two
    best logits within 2% of the largest, or, in a MoE model, a route at the last position that a
    rounding could flip (the k-th and (k+1)-th experts' router probabilities within 0.01)."""
    import engine.backends.numpy.ops as ops
    from tests.kernels.test_cuda_model import prefill_logits

    gaps = []
    real = ops.route

    def watched(logits, top_k, normalize):
        p = np.sort(ops.softmax_inplace(np.array(logits[-1:], dtype=np.float32))[0])[::-1]
        if top_k < len(p):
            gaps.append(float(p[top_k - 1] - p[top_k]))
        return real(logits, top_k, normalize)

    ops.route = watched
    try:
        logits = prefill_logits(ref, seq, list(range(100, 100 + -(-len(seq) // 16))))
    finally:
        ops.route = real
    top2 = np.sort(logits)[-2:]
    return bool(top2[1] - top2[0] < 0.02 * (np.abs(logits).max() + 1e-6) or (gaps and min(gaps) < 0.01))


def test_released_window_pages_are_never_read(model):
    """All layers slide: block-table entries wholly behind the window set to -1 change nothing,
    in chunked prefill over a retained prefix and in decode rounds."""
    from engine.backend import DecodeLane, PrefillSpan, StepOutput
    from engine.backends.cuda import CudaBackend
    from tests.kernels.test_cuda_model import _greedy

    kind, cfg, _, be = model
    if kind != "sliding":
        pytest.skip("the all-sliding model only")
    assert CudaBackend.releases_window_pages
    window, bs = 40, 16
    rng = np.random.default_rng(3)
    ids = rng.integers(0, cfg.vocab_size, 160).tolist()

    def released(table, first_pos):
        first = max(0, first_pos - window + 1) // bs
        return [-1 if b < first else t for b, t in enumerate(table)]

    runs = []
    for release in (False, True):
        table = list(range(300, 312))
        logits = []
        for a in range(0, 160, 40):
            t = released(table, a) if release else table
            out = StepOutput()
            be.prefill(PrefillSpan(seq_id=0, token_ids=ids[a : a + 40], start_pos=a, block_table=t,
                                   want_logits=True, sample=_greedy()), out)  # fmt: skip
            logits.append(out.prefill_logits)
        tok, toks = out.prefill_token, []
        for pos in range(160, 176):
            t = released(table, pos) if release else table
            out = StepOutput()
            be.decode_round([DecodeLane(seq_id=0, token_id=tok, position=pos, block_table=t, sample=_greedy())], out)
            tok = out.decode_tokens[0]
            toks.append((tok, out.decode_logprobs[0].logprob))
        runs.append((np.stack(logits), toks))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
