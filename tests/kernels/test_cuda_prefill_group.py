"""Prompts prefilled together on the CUDA backend (CudaBackend.prefill_group, issue 15 point 4).

Anywhere: which spans of a group run as one pass and where their rows sit
(engine/backends/cuda/prefill_rows.py), and the backend's host side of a group against a
stand-in forward and kernels (what it stages, which passes it launches, which draw each span
gets back). On the GPU: each span of a group gets exactly what its ``prefill`` alone gets (its
first token and logprobs, greedy and seeded, and the K/V it writes, so the decode rounds after
it agree too), on models of both prefill attention kernels, a soft-capped head, sliding windows
and sinks, and MoE layers (``MODELS``); and a burst through the scheduler gives the tokens of one
prompt a step. The alone and grouped runs write into different fresh blocks, so a span
reading another's pages (or its own stale ones) shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
from engine.backends.cuda import sampling
from engine.backends.cuda.prefill_rows import has_penalties, head_slices, layout, prefill_fields
from engine.sampling import SamplingParams
from tests.kernels.gpu import gpu


def _span(i: int, n: int, start: int = 0, table=(0, 1, 2, 3, 4, 5, 6, 7), **kw) -> PrefillSpan:
    kw = {"sample": SampleRequest(params=SamplingParams(temperature=0), seed=i), **kw}
    return PrefillSpan(seq_id=i, token_ids=list(range(3, 3 + n)), start_pos=start, block_table=list(table), **kw)


# --- which spans join a pass (anywhere) ------------------------------------------------------


def test_layout_takes_plain_spans_the_gemm_takes_alone():
    from engine.models.vision import Image

    pen = SampleRequest(params=SamplingParams(temperature=0, repetition_penalty=1.1), seed=0, prompt_token_ids=[5])
    spans = [
        _span(0, 40),
        _span(1, 16),  # the GEMV's rows alone: alone
        _span(2, 17, start=32, table=range(10, 13)),
        _span(3, 30, want_logits=True),  # decide: alone
        _span(4, 30, want_prompt_logprobs=2),  # prompt scoring: alone
        _span(5, 30, sample=pen),  # a penalty list: alone
        _span(6, 30, images=[Image(hash="h", offset=0, num_tokens=1, grid_thw=(1, 2, 2), pixel_values=None)]),
        _span(7, 30, sample=None),  # not sampled: joins, no head row
        _span(8, 50),  # more than the 13 rows left: alone
        _span(9, 13),  # fits, but narrow: alone
        _span(10, 17),  # more than the rows left: alone
    ]
    got = layout(spans, narrow=16, max_rows=100, max_spans=8)
    assert [(r.index, r.row0, r.rows, r.table0, r.start, r.last) for r in got] == [
        (0, 0, 40, 0, 0, 39),
        (2, 40, 17, 8, 32, 56),
        (7, 57, 30, 11, 0, 86),
    ]
    assert [r.index for r in layout(spans, narrow=16, max_rows=100, max_spans=2)] == [0, 2]
    assert layout(spans[:2], narrow=16, max_rows=100, max_spans=8) == []  # one span: it prefills alone
    assert layout([_span(0, 20), _span(1, 0)], narrow=16, max_rows=100, max_spans=8) == []  # empty: alone (raises)


def test_has_penalties_is_false_only_for_empty_penalty_lists():
    rng = np.random.default_rng()
    for _ in range(200):
        params = SamplingParams(
            temperature=0.7,
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, 0.3])),
        )
        req = SampleRequest(params=params, seed=1, prompt_token_ids=rng.integers(0, 50, 6).tolist(),
                            output_token_ids=rng.integers(0, 50, int(rng.integers(0, 3))).tolist())  # fmt: skip
        if not has_penalties(req):
            assert len(sampling.penalty_list(req, 50)[0]) == 0, params
    assert not has_penalties(None)


def test_head_slices_cover_the_rows_in_gemv_widths():
    assert head_slices(1, 16) == [(0, 1)]
    assert head_slices(16, 16) == [(0, 16)]
    assert head_slices(40, 16) == [(0, 16), (16, 16), (32, 8)]
    assert head_slices(9, 8) == [(0, 8), (8, 1)]


# --- the backend's host side, against a stand-in device (anywhere) --------------------------


class _Staging:
    """runtime.Staging's interface over plain arrays: the 'device' reads the host views."""

    def __init__(self, fields) -> None:
        self.view = {n: np.zeros(count, dtype) for n, (dtype, count) in fields.items()}
        self.ptr, off = {}, 1 << 20
        for n, (dtype, count) in fields.items():
            self.ptr[n] = off
            off += np.dtype(dtype).itemsize * count
        self.uploads = []

    def upload(self, stream, first, last=None, nbytes=None) -> None:
        self.uploads.append((first, last, nbytes))


class _Forward:
    """Records each pass with the staged rows it would read, and each head launch."""

    def __init__(self, st, per_row: int = 1) -> None:
        self.st, self.per_row, self.passes, self.heads = st, per_row, [], []

    def prefill_rows(self, rows, tokens, positions, slots, spans, embeds=(), span_table=0) -> None:
        v, p, k = self.st.view, self.st.ptr, self.per_row
        assert span_table in (0, p["span_table"])
        staged = v["span_table"][: 4 * len(spans)].reshape(-1, 4).copy() if span_table else None
        first = (tokens - p["tokens"]) // 4
        assert (positions - p["positions"]) // (4 * k) == first == (slots - p["slots"]) // 4
        tables = [v["block_table"][(bt - p["block_table"]) // 4 :] for _, _, bt, _ in spans]
        self.passes.append(dict(rows=rows, spans=[(r0, n, start) for r0, n, _, start in spans], tables=tables,
                                tokens=v["tokens"][first : first + rows].copy(),
                                positions=v["positions"][k * first : k * (first + rows)].reshape(rows, k).copy(),
                                slots=v["slots"][first : first + rows].copy(), span_table=staged))  # fmt: skip

    def head(self, rows, x_row, out_row=0) -> None:
        self.heads.append((rows, x_row, out_row))


def _host_backend(monkeypatch, vocab=64, hidden=32, block_size=4, max_context=64, mrope=False):
    """A CudaBackend whose device is stand-ins: its prefill code runs here, every launch recorded."""
    from engine.backends.cuda import CudaBackend
    from engine.cu import runtime
    from engine.model_config import ModelConfig

    copies = []
    driver = types.ModuleType("pycuda.driver")
    driver.memcpy_dtod_async = lambda dst, src, size, stream=None: copies.append((dst, src, size))
    driver.memcpy_dtoh_async = lambda dest, src, stream=None: None
    driver.memcpy_htod_async = lambda dest, src, stream=None: None
    pycuda = types.ModuleType("pycuda")
    pycuda.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", pycuda)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    monkeypatch.setattr(runtime, "current", contextlib.nullcontext)

    be = CudaBackend()
    be.tuning = dataclasses.replace(be.tuning, attention_spans=True)  # (off by default: the test below turns it off)
    be.config = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    be.block_size, be.max_context, be.mrope = block_size, max_context, mrope
    be.bt_stride, be.pen_stride = max_context // block_size, min(vocab, max_context)
    be.pstage = _Staging(prefill_fields(64, be.bt_stride, max_context, be.pen_stride, mrope=mrope))
    be.forward = _Forward(be.pstage, 3 if mrope else 1)
    be.stream = SimpleNamespace(synchronize=lambda: None)
    be.ws = SimpleNamespace(x=1 << 30, logits=1 << 31)
    be.weights = SimpleNamespace(lm_head=1 << 32)  # a bf16 pointer: the GEMV takes 64 rows of it
    be.logits_host = np.zeros((64, vocab), np.float32)
    v = be.pstage.view

    def sample(s, logits, vocab, params, seeds, positions, out, rows):  # the draw: 1000 + its sample position
        assert logits == be.ws.logits
        v["out"][:rows] = 1000 + v["sample_pos"][:rows]

    be.kern = SimpleNamespace(gemv_cap=4, penalties=lambda *a: None, sample=sample)
    be.prefill_gemv_rows = 4  # what _capture leaves the cap at
    return be, copies


def test_a_group_stages_one_pass_of_its_wide_spans_and_hands_each_its_draw(monkeypatch):
    be, copies = _host_backend(monkeypatch)
    pen = SampleRequest(params=SamplingParams(temperature=0, repetition_penalty=1.3), seed=0, prompt_token_ids=[4])
    spans = [
        _span(0, 6, table=[7, 8]),
        _span(1, 3, table=[9]),  # narrow (gemv_cap 4): alone
        _span(2, 5, start=8, table=[20, 21, 22, 23]),  # after a retained prefix of 8 positions
        _span(3, 7, table=[30, 31], sample=pen),  # penalties: alone
        _span(4, 9, start=2, table=[40, 41, 42]),
        _span(5, 5, table=[50, 51], sample=None),
    ]
    outs = [StepOutput() for _ in spans]
    be.prefill_group(spans, outs)
    f = be.forward
    # spans 1 and 3 alone (in order), then one pass of 0, 2, 4, 5
    assert [p["spans"] for p in f.passes] == [[(0, 3, 0)], [(0, 7, 0)],
                                             [(0, 6, 0), (6, 5, 8), (11, 9, 2), (20, 5, 0)]]  # fmt: skip
    one = f.passes[2]
    assert one["rows"] == 25
    together = [spans[i] for i in (0, 2, 4, 5)]
    np.testing.assert_array_equal(one["tokens"], np.concatenate([s.token_ids for s in together]))
    pos = np.concatenate([np.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in together])
    np.testing.assert_array_equal(one["positions"][:, 0], pos)
    blocks = np.concatenate([np.asarray(s.block_table)[np.arange(s.start_pos, s.start_pos + len(s.token_ids)) // 4]
                             for s in together])  # fmt: skip
    np.testing.assert_array_equal(one["slots"], blocks * 4 + pos % 4)
    for s, t in zip(together, one["tables"]):
        assert list(t[: len(s.block_table)]) == s.block_table
    # the pass's spans on the device for the one attention launch a layer: (first row, n, start, first table
    # entry from the first span's); the spans alone stage none (one attention launch of their own)
    assert [p["span_table"] for p in f.passes[:2]] == [None, None]
    entries = [0, 2, 2 + 4, 2 + 4 + 3]  # the tables' lengths, one after another
    assert one["span_table"].tolist() == [[r0, n, start, e] for (r0, n, start), e in zip(one["spans"], entries)]
    assert ("span_table", None, 16 * 4) in be.pstage.uploads
    # the sampled spans' last rows (5, 10, 19) to rows 0, 1, 2 of ws.x; one head slice of 3 rows after the
    # two alone (1 row each)
    row = 4 * be.config.hidden_size
    assert copies == [(be.ws.x + row * j, be.ws.x + row * last, row) for j, last in ((0, 5), (1, 10), (2, 19))]
    assert f.heads == [(1, 2, 0), (1, 6, 0), (3, 0, 0)]
    # every sampled span gets the draw at its own sample position (start + rows); the unsampled one none
    assert [o.prefill_token for o in outs] == [1006, 1003, 1013, 1007, 1011, None]
    assert be.pstage.view["pen_num"][:3].tolist() == [0, 0, 0]


def test_with_cuda_attention_spans_off_a_pass_stages_no_span_table(monkeypatch):
    be, _ = _host_backend(monkeypatch)
    be.tuning = dataclasses.replace(be.tuning, attention_spans=False)
    spans = [_span(0, 6, table=[7, 8]), _span(1, 5, start=8, table=[20, 21, 22, 23])]
    be.prefill_group(spans, [StepOutput() for _ in spans])
    (one,) = be.forward.passes
    assert one["spans"] == [(0, 6, 0), (6, 5, 8)] and one["span_table"] is None
    assert not [u for u in be.pstage.uploads if u[0] == "span_table"]


def test_a_group_on_multimodal_rope_stages_three_positions_a_row(monkeypatch):
    be, _ = _host_backend(monkeypatch, mrope=True)
    three = np.array([[5, 6, 7, 8, 9], [5, 5, 6, 6, 7], [5, 6, 5, 6, 5]])  # a span's own (t, h, w) positions
    spans = [_span(0, 6, table=[1, 2]), _span(1, 5, start=4, table=[3, 4, 5], rope_positions=three)]
    outs = [StepOutput() for _ in spans]
    be.prefill_group(spans, outs)
    (one,) = be.forward.passes
    assert one["spans"] == [(0, 6, 0), (6, 5, 4)]
    np.testing.assert_array_equal(one["positions"][:6], np.repeat(np.arange(6)[:, None], 3, axis=1))
    np.testing.assert_array_equal(one["positions"][6:], three.T)
    np.testing.assert_array_equal(one["slots"], [4, 5, 6, 7, 8, 9, 16, 17, 18, 19, 20])
    assert [o.prefill_token for o in outs] == [1006, 1009]


def test_a_group_of_narrow_spans_prefills_one_by_one(monkeypatch):
    be, _ = _host_backend(monkeypatch)
    spans = [_span(0, 2), _span(1, 4), _span(2, 1)]
    outs = [StepOutput() for _ in spans]
    be.prefill_group(spans, outs)
    assert [p["spans"] for p in be.forward.passes] == [[(0, 2, 0)], [(0, 4, 0)], [(0, 1, 0)]]
    assert [o.prefill_token for o in outs] == [1002, 1004, 1001]


# --- on the GPU ------------------------------------------------------------------------------

BLOCK = 16
SEQ_BLOCKS = 8  # 128 positions a sequence: prefix + span + the decode rounds
# Groups of 1, 3 and 8 spans: (span tokens, retained prefix before it). Spans of at most gemv_cap (16)
# rows prefill alone inside the group; a prefix of 20 ends inside a block.
GROUPS = {
    "one": [(40, 0)],
    "three": [(17, 0), (60, 32), (33, 0)],
    "eight": [(1, 0), (60, 0), (17, 0), (24, 16), (33, 0), (40, 20), (48, 0), (5, 32)],
}
TINY_LLAMA = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False, initializer_range=0.05)  # fmt: skip


# Hugging Face models (head_dim 64: attention_prefill.cu; 128: attention_prefill_hopper.cu on sm_90),
# and test_cuda_archs' synthetic ones: gemma2-like (head_dim 256, post-norms, the head's soft-cap on
# the pass's head rows), gpt-oss-like (sinks, sliding windows, biases), qwen3-moe-like (MoE layers).
MODELS = ("qwen2_hd64", "llama_hd128", "gemma2", "gpt_oss", "qwen3_moe")


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    mp = pytest.MonkeyPatch()
    if request.param in ("qwen2_hd64", "llama_hd128"):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        from tests.kernels.hf_models import DEFAULT_ROPE, QWEN_SMALL, random_model
        from tests.kernels.test_cuda_model import load_cuda

        if request.param == "qwen2_hd64":
            model, cfg = random_model("qwen2", DEFAULT_ROPE, **QWEN_SMALL)
        else:
            model, cfg = random_model("llama", DEFAULT_ROPE, **TINY_LLAMA)
        be, _ = load_cuda(model, cfg, as_numpy=True, max_context=1024, kv=256 << 20)
        del model
    else:
        from engine.backends import create_backend
        from engine.models import DEFINITIONS
        from tests.kernels import test_cuda_archs as archs

        make, extra, cfg_kw = archs.MODELS[request.param]
        name = f"test_cuda_group_{request.param}"
        d = archs.Synthetic(name, (), (), make_block=make, **extra)
        mp.setitem(DEFINITIONS, name, d)  # undone when this model's tests are done
        cfg = archs._cfg(name, **cfg_kw)
        be = create_backend("cuda")
        be.load(cfg, archs.random_weights(d, cfg), block_size=BLOCK, kv_budget_bytes=256 << 20,
                host_kv_budget_bytes=0, max_context=1024)  # fmt: skip
    be.next_block = 0  # the next block ``_tables`` hands out
    # cuda.attention_spans (off by default until this file has run on a card): a pass's spans in one
    # attention launch where the Hopper kernel covers the layer, so the bitwise checks below cover it
    be.tuning = dataclasses.replace(be.tuning, attention_spans=True)
    yield be
    be.unload()
    mp.undo()


def _tables(be, n: int) -> list[list[int]]:
    """Tables of fresh, zeroed blocks: the alone and grouped runs never share one."""
    import pycuda.driver as cuda

    from engine.cu import runtime

    first = be.next_block
    be.next_block += n * SEQ_BLOCKS
    assert be.next_block <= be.plan.num_blocks
    with runtime.current():
        cuda.memset_d8(be.kv.base + first * be.kv.block_bytes, 0, n * SEQ_BLOCKS * be.kv.block_bytes)
    return [list(range(first + i * SEQ_BLOCKS, first + (i + 1) * SEQ_BLOCKS)) for i in range(n)]


def _request(i: int, seeded: bool) -> SampleRequest:
    params = SamplingParams(temperature=0.8, top_p=0.95) if seeded else SamplingParams(temperature=0)
    return SampleRequest(params=params, seed=1000 + i, num_logprobs=5, want_logprobs=i % 2 == 0)


def _blocks(be, table) -> np.ndarray:
    """The bits of a table's KV blocks (every layer, K and V)."""
    import pycuda.driver as cuda

    from engine.cu import runtime

    out = np.empty((len(table), be.kv.block_bytes), np.uint8)
    with runtime.current():
        be.stream.synchronize()
        for j, b in enumerate(table):
            cuda.memcpy_dtoh(out[j], be.kv.base + b * be.kv.block_bytes)
    return out


def _run(be, prompts, group, seeded: bool, rounds: int = 4):
    """Prefixes alone, then the spans alone (``group`` False) or as one group; then ``rounds`` decode
    rounds of all the sequences. Returns (prefill outputs, KV blocks, decoded (token, logprob) lists,
    the spans each forward pass ran)."""
    tables = _tables(be, len(prompts))
    for i, (ids, start) in enumerate(prompts):
        if start:
            be.prefill(PrefillSpan(i, ids[:start], 0, tables[i]), StepOutput())
    spans = [PrefillSpan(i, ids[start:], start, tables[i], sample=_request(i, seeded))
             for i, (ids, start) in enumerate(prompts)]  # fmt: skip
    outs = [StepOutput() for _ in spans]
    passes, forward = [], be.forward.prefill_rows
    be.forward.prefill_rows = lambda rows, *a, **kw: passes.append(len(a[3])) or forward(rows, *a, **kw)
    try:
        if group:
            be.prefill_group(spans, outs)
        else:
            for span, out in zip(spans, outs):
                be.prefill(span, out)
    finally:
        del be.forward.prefill_rows
    kv = [_blocks(be, t) for t in tables]
    seqs = [[o.prefill_token] for o in outs]
    decoded = [[] for _ in prompts]
    for _ in range(rounds):
        lanes = [DecodeLane(seq_id=i, token_id=seqs[i][-1], position=len(ids) + len(seqs[i]) - 1,
                            block_table=tables[i], sample=_request(i, seeded))
                 for i, (ids, _) in enumerate(prompts)]  # fmt: skip
        out = StepOutput()
        be.decode_round(lanes, out)
        for i, (t, lp) in enumerate(zip(out.decode_tokens, out.decode_logprobs)):
            seqs[i].append(t)
            decoded[i].append((t, None if lp is None else (lp.logprob, lp.top)))
    return outs, kv, decoded, passes


def _logprob(out: StepOutput):
    lp = out.prefill_logprob
    return None if lp is None else (lp.token_id, lp.logprob, lp.top)


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("name", list(GROUPS))
def test_each_span_of_a_group_gets_the_bits_of_its_prefill_alone(loaded, name, seeded):
    be = loaded
    rng = np.random.default_rng()
    prompts = [(rng.integers(0, be.config.vocab_size, start + n).tolist(), start) for n, start in GROUPS[name]]
    alone, kv_alone, dec_alone, passes_alone = _run(be, prompts, False, seeded)
    grouped, kv_grouped, dec_grouped, passes = _run(be, prompts, True, seeded)
    # one pass for the spans the GEMM takes alone (when two or more), one each for the others
    wide = sum(n > be.kern.gemv_cap for n, _ in GROUPS[name])
    joined = wide if wide > 1 else 0
    assert sorted(passes) == sorted([1] * (len(prompts) - joined) + ([joined] if joined else []))
    assert passes_alone == [1] * len(prompts)
    for i in range(len(prompts)):
        assert grouped[i].prefill_token == alone[i].prefill_token, i
        assert _logprob(grouped[i]) == _logprob(alone[i]), i
        np.testing.assert_array_equal(kv_grouped[i], kv_alone[i], err_msg=f"span {i}'s KV blocks")
        assert dec_grouped[i] == dec_alone[i], i


def _bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@gpu
@pytest.mark.slow
def test_a_group_is_close_to_its_spans_alone(loaded):
    """The tolerant form of the test above: should the GEMM's rows ever depend on the rows beside
    them, the group still agrees within rounding (greedy tokens, logprobs, K/V by cosine); this one
    passing while the bitwise one fails says it is rounding, not a span reading the wrong rows."""
    be = loaded
    rng = np.random.default_rng()
    prompts = [(rng.integers(0, be.config.vocab_size, start + n).tolist(), start) for n, start in GROUPS["eight"]]
    alone, kv_alone, _, _ = _run(be, prompts, False, False, rounds=1)
    grouped, kv_grouped, _, _ = _run(be, prompts, True, False, rounds=1)
    for i in range(len(prompts)):
        assert grouped[i].prefill_token == alone[i].prefill_token, i
        if alone[i].prefill_logprob is not None:
            assert abs(grouped[i].prefill_logprob.logprob - alone[i].prefill_logprob.logprob) < 1e-2, i
        a, b = _bf16(kv_alone[i]).astype(np.float64).ravel(), _bf16(kv_grouped[i]).astype(np.float64).ravel()
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30) >= 0.9999, i


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("sampling_args", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_a_burst_through_the_scheduler_gives_the_tokens_of_one_prompt_a_step(loaded, sampling_args):
    from tests.engine.test_prefill_group import _generate

    be = loaded
    rng = np.random.default_rng()
    prompts = [rng.integers(3, be.config.vocab_size, n).tolist() for n in (17, 60, 30, 45)]

    def generate(group: bool):
        return _generate(be, prompts, group, sampling_args)

    together, steps_together = generate(True)
    alone, steps_alone = generate(False)
    assert (steps_together, steps_alone) == (1, 4)
    assert together == alone  # the cuda backend's decode lanes do not depend on their round's width


def test_decode_graphs_take_the_wide_gemv_and_prefill_passes_a_plain_rounds_cap():
    """cuda.known_rows widens decode rounds only: the graphs are captured with the GEMV taking the
    widest round's rows, and the prefill passes (eager) then see cuda.round_rows' cap, so a span past
    it runs the GEMM and may join its group's pass (CudaBackend._capture)."""
    from engine.backends.cuda import CudaBackend
    from engine.config import CudaTuning

    be = CudaBackend(CudaTuning(known_rows=64))
    be.max_round_rows, be.prefill_gemv_rows = 64, 16
    seen = []
    be.kern = SimpleNamespace(gemv_cap=0)
    be.graphs = SimpleNamespace(capture=lambda: seen.append(be.kern.gemv_cap))
    be._capture()
    assert seen == [64] and be.kern.gemv_cap == 16
