"""The numpy backend against Hugging Face transformers (torch, float32) on the same weights.

Relative error is ``max|ours - theirs| / max|theirs|`` over the last position's logits.
The backend is driven directly through the step interface: one prefill, then decode rounds.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
from engine.backends.numpy import NumpyBackend
from engine.loaders import artifact_format, load_artifact
from engine.model_config import ModelConfig
from engine.models import definition
from engine.sampling import SamplingParams

MAX_REL_ERR = 1e-4
BLOCK = 16
GREEDY = SampleRequest(params=SamplingParams(temperature=0), seed=0)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris, Berlin, Madrid, Rome and",
]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def load_backend(cfg: ModelConfig, weights: dict, num_blocks: int = 64) -> NumpyBackend:
    backend = NumpyBackend()
    block_bytes = BLOCK * cfg.kv_bytes_per_token_fp32
    backend.load(
        cfg, weights, block_size=BLOCK, kv_budget_bytes=num_blocks * block_bytes,
        host_kv_budget_bytes=8 * block_bytes, max_context=num_blocks * BLOCK,
    )  # fmt: skip
    return backend


def greedy(backend: NumpyBackend, ids: list[int], n: int, blocks: list[int]) -> tuple[np.ndarray, list[int]]:
    """Prefill ``ids`` then ``n - 1`` decode rounds; return the prefill logits and ``n`` tokens."""
    out = StepOutput()
    backend.prefill(PrefillSpan(0, ids, 0, blocks, sample=GREEDY, want_logits=True), out)
    tokens = [out.prefill_token]
    for _ in range(n - 1):
        step = StepOutput()
        backend.decode_round([DecodeLane(0, tokens[-1], len(ids) + len(tokens) - 1, blocks, GREEDY)], step)
        tokens.append(step.decode_tokens[0])
    return out.prefill_logits, tokens


def hf_greedy(model, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        first = out.logits[0, -1].numpy().copy()
        tokens = [int(out.logits[0, -1].argmax())]
        past = out.past_key_values
        for _ in range(n - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return first, tokens


# --- the bundled GGUF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_backend(default_gguf_path):
    cfg, weights = load_artifact(default_gguf_path)
    return load_backend(cfg, weights)


@pytest.fixture(scope="module")
def gguf_tokenizer(default_gguf_path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def hf_gguf_model(default_gguf_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.slow
def test_gguf_logits_and_greedy_match_hf(gguf_backend, gguf_tokenizer, hf_gguf_model):
    blocks = list(range(8))
    for i, prompt in enumerate(PROMPTS):
        ids = gguf_tokenizer.encode(prompt)
        ours, our_tokens = greedy(gguf_backend, ids, 32 if i == 0 else 1, blocks)
        theirs, their_tokens = hf_greedy(hf_gguf_model, ids, 32 if i == 0 else 1)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, prompt
        assert our_tokens == their_tokens, prompt


@pytest.mark.slow
def test_gguf_model_knows_the_capital_of_france(gguf_backend, gguf_tokenizer):
    from engine.chat_template import render_chat

    tok = gguf_tokenizer
    prompt = render_chat(
        tok.chat_template, [{"role": "user", "content": "What is the capital of France?"}],
        bos_token=tok.bos_token, eos_token=tok.eos_token,
    )  # fmt: skip
    _, tokens = greedy(gguf_backend, tok.encode(prompt), 24, list(range(8)))
    if set(tokens) & set(tok.eos_token_ids):
        tokens = tokens[: min(tokens.index(e) for e in tok.eos_token_ids if e in tokens)]
    assert "Paris" in tok.decode(tokens)


# --- tiny random checkpoints written by transformers --------------------------------------


def _tiny_checkpoint(kind: str, path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)  # fmt: skip
    if kind == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}  # fmt: skip
        cfg = transformers.LlamaConfig(num_hidden_layers=3, rope_theta=500000.0, rope_scaling=scaling, **common)
        model = transformers.LlamaForCausalLM(cfg)
        model.save_pretrained(path, max_shard_size="100KB")  # sharded: exercises the index
    elif kind == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint; pad id inside the tiny vocab
        cfg = transformers.Phi3Config(num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        transformers.Phi3ForCausalLM(cfg).save_pretrained(path)
    else:
        cfg = transformers.Qwen2Config(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random biases: zero ones would hide a missing bias add
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
        model.to(torch.bfloat16).save_pretrained(path)  # bf16 on disk: exercises the raw bf16 path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "phi3"])
def test_tiny_checkpoints_match_hf(kind, tmp_path):
    import torch
    import transformers

    _tiny_checkpoint(kind, tmp_path)
    assert artifact_format(tmp_path) == "hf"
    cfg, weights = load_artifact(tmp_path)
    assert set(weights) >= set(definition(cfg.arch).tensors(cfg))
    if kind == "qwen2":
        assert cfg.attention_bias and cfg.tie_word_embeddings
    elif kind == "phi3":
        assert cfg.arch == "phi3" and not any("qkv_proj" in n or "gate_up_proj" in n for n in weights)
    else:
        assert cfg.rope_scaling["rope_type"] == "llama3"
    backend = load_backend(cfg, weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    for n in (3, 17, 40):
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        ours, our_tokens = greedy(backend, ids, 32, list(range(8)))
        theirs, their_tokens = hf_greedy(hf, ids, 32)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, n
        assert our_tokens == their_tokens, n


def _write_phi3_gguf(hf_dir, path) -> None:
    """The tiny phi3 checkpoint as llama.cpp's converter lays it out: F32, fused attn_qkv and ffn_up."""
    import gguf

    from engine.loaders.hf import read_safetensors

    hf = json.loads((hf_dir / "config.json").read_text())
    w = read_safetensors(hf_dir / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(hf["hidden_size"] // hf["num_attention_heads"])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip
    for name, t in w.items():
        if name.startswith("model.layers."):
            _, _, i, suffix = name.split(".", 3)
            writer.add_tensor(f"blk.{i}.{names[suffix]}", t)
        else:
            writer.add_tensor(names[name], t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_phi3_gguf_loads_as_its_hf_checkpoint(tmp_path):
    """llama.cpp's phi3 layout (fused attn_qkv, gate|up in ffn_up, q/k rows unpermuted) maps onto the
    same canonical tensors, bit for bit, and the same config as the safetensors checkpoint."""
    _tiny_checkpoint("phi3", tmp_path / "hf")
    _write_phi3_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    assert artifact_format(tmp_path / "tiny.gguf") == "gguf"
    hf_cfg, hf_weights = load_artifact(tmp_path / "hf")
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    assert cfg.rms_norm_eps == np.float32(hf_cfg.rms_norm_eps)  # GGUF keeps eps as a float32
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert set(weights) == set(hf_weights) == set(definition("phi3").tensors(cfg))
    for name, w in hf_weights.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)


# --- batching and chunking, on a random numpy model (no transformers needed) -------------


def random_model(seed: int = 0) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    cfg = ModelConfig(arch="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, attention_bias=True)  # fmt: skip
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in definition(cfg.arch).tensors(cfg).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        weights[name] = (base + rng.normal(0, 0.3, shape)).astype(np.float32)
    return cfg, weights


def test_batched_decode_round_matches_each_lane_alone():
    backend = load_backend(*random_model())
    rng = np.random.default_rng(2)
    lanes = []
    for seq, n in enumerate((5, 23, 40, 1)):
        blocks = [10 * seq + b for b in range(4)]  # disjoint, non-contiguous across lanes
        ids = rng.integers(0, 128, n).tolist()
        backend.prefill(PrefillSpan(seq, ids, 0, blocks), StepOutput())
        lanes.append(DecodeLane(seq, int(rng.integers(0, 128)), n, blocks, GREEDY))
    together = backend.decode_logits(lanes)
    out = StepOutput()
    backend.decode_round(lanes, out)
    for row, lane in enumerate(lanes):
        alone = backend.decode_logits([lane])[0]
        assert rel_err(together[row], alone) <= MAX_REL_ERR
        assert out.decode_tokens[row] == int(np.argmax(alone))


def test_prefill_in_two_chunks_equals_one():
    backend = load_backend(*random_model())
    ids = np.random.default_rng(3).integers(0, 128, 37).tolist()
    one, two = StepOutput(), StepOutput()
    backend.prefill(PrefillSpan(0, ids, 0, [0, 1, 2], sample=GREEDY, want_logits=True), one)
    backend.prefill(PrefillSpan(1, ids[:20], 0, [5, 7, 3]), StepOutput())
    backend.prefill(PrefillSpan(1, ids[20:], 20, [5, 7, 3], sample=GREEDY, want_logits=True), two)
    assert rel_err(two.prefill_logits, one.prefill_logits) <= MAX_REL_ERR
    assert two.prefill_token == one.prefill_token
    # float32 noise between chunk shapes (BLAS picks kernels by shape) is ~3e-6 here on values of order 1
    np.testing.assert_allclose(backend.k[:, [5, 7, 3]], backend.k[:, [0, 1, 2]], rtol=1e-5, atol=1e-5)


def test_swap_moves_kv_contents():
    backend = load_backend(*random_model())
    ids = list(range(30))
    backend.prefill(PrefillSpan(0, ids, 0, [0, 1]), StepOutput())
    before_k, before_v = backend.k[:, [0, 1]].copy(), backend.v[:, [0, 1]].copy()
    backend.swap_out([(0, 3), (1, 4)])
    backend.k[:, [0, 1]] = 0
    backend.v[:, [0, 1]] = 0
    backend.swap_in([(3, 6), (4, 2)])
    np.testing.assert_array_equal(backend.k[:, [6, 2]], before_k)
    np.testing.assert_array_equal(backend.v[:, [6, 2]], before_v)


def test_memory_plan_sizes_the_pool_from_the_budget():
    cfg, weights = random_model()
    backend = NumpyBackend()
    block_bytes = 16 * cfg.kv_bytes_per_token_fp32
    plan = backend.load(cfg, weights, block_size=16, kv_budget_bytes=10 * block_bytes + 5,
                        host_kv_budget_bytes=3 * block_bytes, max_context=512)  # fmt: skip
    assert (plan.num_blocks, plan.num_host_blocks, plan.kv_bytes) == (10, 3, 10 * block_bytes)
    assert backend.k_cache[0].shape == (10, 16, cfg.num_kv_heads, cfg.head_dim)
    assert plan.weights_bytes >= sum(w.nbytes for w in weights.values())
    plan = NumpyBackend().load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0,
                               max_context=512)  # fmt: skip
    assert plan.num_blocks == 512 // 16 * 8


def test_prompt_logprobs_score_every_position_across_chunks_and_claim_no_prefix():
    """AddRequest.prompt_logprobs through the scheduler and the numpy backend: the prompt spans three
    chunks; each position's score is the log-softmax of the logits a prefill of the prefix alone gives;
    a repeat of the prompt claims no retained prefix (every position must run again)."""
    import random

    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest
    from engine.sampler import log_softmax
    from engine.scheduler import Scheduler

    backend = load_backend(*random_model())
    cfg = EngineConfig(decode_lanes=2, prefill_chunk=16, max_context=256, block_size=BLOCK, default_max_tokens=4)
    sched = Scheduler(cfg, KVManager(48, BLOCK, 8), seed_rng=random.Random(0))
    ids = np.random.default_rng(5).integers(0, 128, 40).tolist()

    def run(request_id: str, prompt_logprobs: int | None) -> list[dict]:
        add = AddRequest(request_id, "r", ids, 2, sampling={"temperature": 0}, prompt_logprobs=prompt_logprobs)
        assert sched.add_request(add) is None
        msgs = []
        while sched.has_work:
            plan = sched.schedule()
            msgs += [m.to_message() for m in sched.update_from_output(plan, backend.step(plan))]
        return msgs

    plain = run("plain", None)
    assert all(m.get("prompt_logprobs") is None for m in plain)
    msgs = run("scored", 3)
    first = next(m for m in msgs if m["type"] == "engine.tokens")
    assert first["cached_tokens"] == 0  # the plain run's retained blocks were not claimed
    assert sum(1 for m in msgs if m.get("prompt_logprobs")) == 1
    lps = first["prompt_logprobs"]
    assert [lp["token_id"] for lp in lps] == ids[1:]
    for p in (1, 15, 16, 17, 33, 39):  # inside a chunk and across both chunk boundaries
        out = StepOutput()
        backend.prefill(PrefillSpan(9, ids[:p], 0, [40, 41, 42], want_logits=True), out)
        ref = log_softmax(out.prefill_logits)
        assert abs(lps[p - 1]["logprob"] - ref[ids[p]]) < 1e-4
        top = [t for t, _ in lps[p - 1]["top"]]
        assert len(top) == 3 and top == list(np.argsort(-ref, kind="stable")[:3])
    assert [m["token_ids"] for m in msgs if m["type"] == "engine.tokens"] == [
        m["token_ids"] for m in plain if m["type"] == "engine.tokens"
    ]  # scoring changes nothing about the generation


def test_prompt_logprobs_refused_when_the_backend_cannot_score():
    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest
    from engine.scheduler import Scheduler

    # The CUDA backend's answer (Backend.supports_prompt_logprobs).
    sched = Scheduler(EngineConfig(), KVManager(16, BLOCK, 0), supports_prompt_logprobs=False)
    refused = sched.add_request(AddRequest("x", "r", [1, 2, 3], 2, prompt_logprobs=0))
    assert refused.status == 400 and refused.code == "unsupported" and refused.param == "logprobs"
    assert sched.add_request(AddRequest("y", "r", [1, 2, 3], 2)) is None


def test_decide_token_ids_return_only_their_log_softmax():
    """AddRequest.decide_token_ids: the RequestFinished carries those ids' log-softmax over the whole
    last-position row (not the row itself); without them, the row as before."""
    import random

    from engine.config import EngineConfig
    from engine.kv_manager import KVManager
    from engine.messages import AddRequest
    from engine.sampler import log_softmax
    from engine.scheduler import Scheduler

    backend = load_backend(*random_model())
    sched = Scheduler(
        EngineConfig(prefill_chunk=16, block_size=BLOCK), KVManager(48, BLOCK, 8), seed_rng=random.Random(0)
    )
    ids = np.random.default_rng(6).integers(0, 128, 21).tolist()

    def finished(**kw) -> dict:
        assert sched.add_request(AddRequest(kw.pop("rid"), "r", ids, 0, decide=True, **kw)) is None
        msgs = []
        while sched.has_work:
            plan = sched.schedule()
            msgs += [m.to_message() for m in sched.update_from_output(plan, backend.step(plan))]
        (done,) = msgs
        return done

    whole = finished(rid="whole")
    assert len(whole["logits"]) == 128 and whole.get("decide_logprobs") is None
    some = finished(rid="some", decide_token_ids=[5, 77, 3, 500])
    assert some["logits"] is None
    ref = log_softmax(np.asarray(whole["logits"], dtype=np.float32))
    assert some["decide_logprobs"][:3] == pytest.approx([ref[5], ref[77], ref[3]], abs=1e-5)
    assert some["decide_logprobs"][3] is None  # outside the vocabulary
