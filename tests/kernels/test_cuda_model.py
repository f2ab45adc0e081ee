"""The whole CUDA backend against Hugging Face transformers and the numpy backend,
on random-weight checkpoints built here: a small qwen2 and a Llama-3.1-8B-shaped
llama (fewer layers, same widths). Skipped without PyCUDA, a CUDA device, torch
or transformers."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda
from tests.kernels.hf_models import DEFAULT_ROPE, LLAMA3_ROPE, LLAMA8B, QWEN_SMALL, random_model

pytestmark = [*requires_cuda, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def hf_last_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda"))
    return out.logits[0, -1].float().cpu().numpy()


def load_cuda(model, cfg, *, as_numpy: bool, max_context=4096, kv=1 << 30):
    from engine.backends.cuda import CudaBackend
    from engine.models import definition

    sd = model.state_dict()
    names = definition(cfg.arch).tensors(cfg)
    weights = {n: (sd[n].float().cpu().numpy() if as_numpy else sd[n]) for n in names}
    be = CudaBackend()
    be.load(cfg, weights, block_size=16, kv_budget_bytes=kv, host_kv_budget_bytes=64 << 20, max_context=max_context)
    return be, weights


def prefill_logits(be, ids, table, start=0, chunks=1):
    from engine.backend import PrefillSpan, StepOutput

    bounds = np.linspace(0, len(ids), chunks + 1).astype(int)
    out = None
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = StepOutput()
        be.prefill(PrefillSpan(seq_id=0, token_ids=ids[a:b], start_pos=start + a, block_table=table,
                               want_logits=(b == len(ids))), out)  # fmt: skip
    return out.prefill_logits


@pytest.fixture(scope="module")
def qwen():
    model, cfg = random_model("qwen2", DEFAULT_ROPE, **QWEN_SMALL)
    be, weights = load_cuda(model, cfg, as_numpy=True)
    yield model, cfg, be, weights
    be.unload()


def test_qwen2_prefill_logits_match_transformers(qwen):
    model, cfg, be, _ = qwen
    rng = np.random.default_rng(1)
    for n, chunks in [(1, 1), (37, 1), (300, 3), (2500, 1)]:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        table = list(range(-(-n // 16)))
        got = prefill_logits(be, ids, table, chunks=chunks)
        ref = hf_last_logits(model, ids)
        assert cosine(got, ref) >= 0.999, (n, chunks, cosine(got, ref))


def _greedy(req_params=None):
    from engine.backend import SampleRequest
    from engine.sampling import SamplingParams

    return SampleRequest(params=req_params or SamplingParams(temperature=0.0), seed=7, want_logprobs=True)


def _run_lanes(backend, prompts, tables, steps, width):
    """Greedy continuations of every prompt, decoded in rounds of ``width`` lanes: (tokens, logprobs) per lane."""
    from engine.backend import DecodeLane, PrefillSpan, StepOutput

    seqs, lps = [], [[] for _ in prompts]
    for i, p in enumerate(prompts):
        out = StepOutput()
        backend.prefill(PrefillSpan(seq_id=i, token_ids=p, start_pos=0, block_table=tables[i], sample=_greedy()), out)
        seqs.append([out.prefill_token])
    for _ in range(steps):
        for g in range(0, len(prompts), width):
            group = range(g, min(len(prompts), g + width))
            lanes = [DecodeLane(seq_id=i, token_id=seqs[i][-1], position=len(prompts[i]) + len(seqs[i]) - 1,
                                block_table=tables[i], sample=_greedy()) for i in group]  # fmt: skip
            out = StepOutput()
            backend.decode_round(lanes, out)
            for i, t, lp in zip(group, out.decode_tokens, out.decode_logprobs):
                seqs[i].append(t)
                lps[i].append(lp.logprob)
    return seqs, lps


def test_qwen2_greedy_matches_numpy_backend_and_widths(qwen):
    """Greedy continuations agree with the numpy backend until the first near-tie,
    and a lane's tokens (and logprobs, bitwise) do not depend on the width of its round."""
    from engine.backends import create_backend

    model, cfg, be, weights = qwen
    ref = create_backend("numpy")
    ref.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=4096)
    rng = np.random.default_rng(2)
    lanes_n = 8
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(5, 60))).tolist() for _ in range(lanes_n)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(lanes_n)]
    steps = 12
    toks: dict[str, list[list[int]]] = {}
    lps: dict[str, list[list[float]]] = {}
    for label, backend, width in [("numpy", ref, lanes_n), ("cuda1", be, 1), ("cuda8", be, 8), ("cuda3", be, 3)]:
        toks[label], lps[label] = _run_lanes(backend, prompts, tables, steps, width)
    # Every decode width runs gemv_tc and the fused epilogues, the same per-lane arithmetic, so a lane's
    # tokens and logits do not depend on its round's width.
    assert toks["cuda1"] == toks["cuda8"] == toks["cuda3"]
    assert lps["cuda1"] == lps["cuda8"] == lps["cuda3"]
    # numpy (float32) vs cuda (bf16): identical up to the first position where the top-2 margin is small.
    for i in range(lanes_n):
        a, b = toks["numpy"][i], toks["cuda1"][i]
        if a == b:
            continue
        j = next(k for k in range(len(a)) if a[k] != b[k])
        logits = hf_last_logits(model, prompts[i] + a[:j])
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < 0.02 * (np.abs(logits).max() + 1e-6), f"lane {i} diverged at {j} without a tie"
    ref.unload()


def test_qwen2_kv_swap(qwen):
    from engine.backend import DecodeLane, PrefillSpan, StepOutput

    _, cfg, be, _ = qwen
    rng = np.random.default_rng(3)
    ids = rng.integers(0, cfg.vocab_size, 40).tolist()
    t_a = [100, 101, 102]
    out = StepOutput()
    be.prefill(PrefillSpan(seq_id=0, token_ids=ids, start_pos=0, block_table=t_a, sample=_greedy()), out)
    first = out.prefill_token

    def step(table):
        o = StepOutput()
        be.decode_round([DecodeLane(seq_id=0, token_id=first, position=40, block_table=table, sample=_greedy())], o)
        return o.decode_tokens[0], o.decode_logprobs[0].logprob

    base = step(t_a)
    be.swap_out([(b, h) for h, b in enumerate(t_a)])
    be.prefill(PrefillSpan(seq_id=1, token_ids=rng.integers(0, cfg.vocab_size, 40).tolist(), start_pos=0,
                           block_table=t_a), StepOutput())  # fmt: skip
    be.swap_in([(h, b) for h, b in enumerate(t_a)])
    assert step(t_a) == base


def test_llama_8b_shape_prefill_logits_match_transformers():
    model, cfg = random_model("llama", LLAMA3_ROPE, **dict(LLAMA8B, num_hidden_layers=2))
    be, _ = load_cuda(model, cfg, as_numpy=False, max_context=16384, kv=2 << 30)
    try:
        rng = np.random.default_rng(4)
        for n, start_pad in [(300, 0), (1200, 0)]:
            ids = rng.integers(0, cfg.vocab_size, n + start_pad).tolist()
            table = list(range(-(-len(ids) // 16)))
            got = prefill_logits(be, ids, table, chunks=2)
            ref = hf_last_logits(model, ids)
            assert cosine(got, ref) >= 0.999, (n, cosine(got, ref))
        # Decode rounds (fused RMSNorm / rope / SwiGLU GEMVs, llama3 rope, head_dim 128): a lane's tokens and
        # logprobs are bitwise the same at widths 1 and 8, and a width-8 round's logits match transformers.
        prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(10, 200))).tolist() for _ in range(8)]
        tables = [list(range(200 + i * 16, 216 + i * 16)) for i in range(8)]
        t1, l1 = _run_lanes(be, prompts, tables, 4, 1)
        t8, l8 = _run_lanes(be, prompts, tables, 4, 8)
        assert t1 == t8
        assert l1 == l8
        for i in (0, 5, 7):  # logits_host holds the last (width-8) round's rows
            ref = hf_last_logits(model, prompts[i] + t8[i][:-1])
            assert cosine(be.logits_host[i], ref) >= 0.999, (i, cosine(be.logits_host[i], ref))
    finally:
        be.unload()
        del model
        torch.cuda.empty_cache()


class _OnlyTokens:
    """A stand-in grammar: only ``allowed`` may be drawn (what engine.constraint's matcher does)."""

    def __init__(self, allowed):
        self.allowed = np.asarray(sorted(allowed))

    def mask_logits(self, x):
        keep = x[self.allowed].copy()
        x[:] = -np.inf
        x[self.allowed] = keep


def test_qwen2_constrained_rows_sample_on_the_host_like_numpy(qwen):
    """A row with a grammar is drawn from the device's logits under the grammar's mask,
    greedy and seeded, beside unconstrained rows, and agrees with the numpy backend."""
    from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
    from engine.backends import create_backend
    from engine.sampling import SamplingParams

    model, cfg, be, weights = qwen
    ref = create_backend("numpy")
    ref.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=4096)
    rng = np.random.default_rng(5)
    allowed = set(rng.choice(cfg.vocab_size, 40, replace=False).tolist())
    prompts = [rng.integers(0, cfg.vocab_size, 20).tolist() for _ in range(3)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]

    def req(i):
        params = SamplingParams(temperature=0.0) if i == 0 else SamplingParams(temperature=0.8, seed=11)
        return SampleRequest(params=params, seed=11 + i, constraint=_OnlyTokens(allowed) if i < 2 else None)

    runs = {}
    for label, backend in (("numpy", ref), ("cuda", be)):
        seqs = []
        for i, p in enumerate(prompts):
            out = StepOutput()
            backend.prefill(PrefillSpan(seq_id=i, token_ids=p, start_pos=0, block_table=tables[i], sample=req(i)), out)
            seqs.append([out.prefill_token])
        for _ in range(6):
            lanes = [DecodeLane(seq_id=i, token_id=seqs[i][-1], position=len(prompts[i]) + len(seqs[i]) - 1,
                                block_table=tables[i], sample=req(i)) for i in range(3)]  # fmt: skip
            out = StepOutput()
            backend.decode_round(lanes, out)
            for i, t in enumerate(out.decode_tokens):
                seqs[i].append(t)
        runs[label] = seqs
    for i in (0, 1):
        assert set(runs["cuda"][i]) <= allowed, i
    assert not set(runs["cuda"][2]) <= allowed  # the unconstrained lane is untouched by its neighbours' masks
    assert runs["cuda"][0] == runs["numpy"][0]  # greedy under the mask: same arithmetic up to bf16 near-ties
    ref.unload()
