"""qwen3 on the numpy backend against transformers, from safetensors and from a llama.cpp GGUF.

The tiny checkpoints carry what distinguishes qwen3 from llama: q/k RMSNorms with
random (not unit) weights, a head_dim (32) other than hidden / heads (16), and,
in the "window" variant, biases on q, k, v and o plus a sliding window on the
layers from ``max_window_layers`` on, short enough (8) that the prompts and the
32-token continuations run far past it; the "yarn" variant scales rope as Qwen3's
long-context recipe does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.loaders import load_artifact
from engine.models import definition, for_gguf, for_hf
from tests.engine.test_hf_parity import MAX_REL_ERR, greedy, hf_greedy, load_backend, rel_err
from tests.models.tiny_qwen import randomize_norms, write_gguf_twin

LENGTHS = (3, 17, 40)  # prompt lengths: within, across and far past the window of 8


def tiny_qwen3(path, kind: str):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    extra = {}
    rope = {"rope_type": "default", "rope_theta": 1e6}
    if kind == "window":
        extra = dict(attention_bias=True, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    elif kind == "yarn":  # Qwen3's long-context recipe, scaled down: factor 4 over an original 64 positions
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=3, max_position_embeddings=256, initializer_range=0.2,
        rope_parameters=rope, tie_word_embeddings=kind == "tied", **extra,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg)
    randomize_norms(model)
    with torch.no_grad():  # random biases: zero ones would hide a missing bias add
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_matches_hf(backend, hf, vocab: int, n_tokens: int = 32) -> None:
    rng = np.random.default_rng(1)
    for n in LENGTHS:
        ids = rng.integers(0, vocab, n).tolist()
        ours, our_tokens = greedy(backend, ids, n_tokens, list(range(8)))
        theirs, their_tokens = hf_greedy(hf, ids, n_tokens)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, n
        assert our_tokens == their_tokens, n


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "window", "yarn"])
def test_tiny_qwen3_matches_hf(kind, tmp_path):
    hf = tiny_qwen3(tmp_path, kind)
    cfg, weights = load_artifact(tmp_path)
    d = definition(cfg.arch)
    assert d is for_hf("qwen3") and cfg.head_dim == 32
    assert {n: w.shape for n, w in weights.items()} == d.tensors(cfg)  # every tensor, and nothing else
    if kind == "window":
        assert cfg.attention_bias and not cfg.tie_word_embeddings
        assert (cfg.sliding_window, cfg.layer_types) == (8, ("full_attention",) + ("sliding_attention",) * 2)
        assert [d.block(cfg, i).attention.sliding_window for i in range(3)] == [None, 8, 8]
        assert d.block(cfg, 0).attention.o_bias
    else:
        assert cfg.sliding_window is None and cfg.tie_word_embeddings == (kind == "tied")
        assert (cfg.rope_scaling or {}).get("rope_type") == ("yarn" if kind == "yarn" else None)
    assert_matches_hf(load_backend(cfg, weights), hf, cfg.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "yarn"])
def test_qwen3_gguf_loads_as_its_hf_checkpoint(kind, tmp_path):
    """llama.cpp's qwen3 layout (attn_q_norm / attn_k_norm, q/k rows in HF order, a tied head
    left out, yarn as rope.scaling.* keys) gives the same config and tensors, bit for bit,
    and transformers' logits."""
    hf = tiny_qwen3(tmp_path / "hf", kind)
    write_gguf_twin(tmp_path / "hf", tmp_path / "tiny.gguf")
    hf_cfg, hf_weights = load_artifact(tmp_path / "hf")
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    assert for_gguf("qwen3") is definition(cfg.arch)
    assert cfg.rms_norm_eps == np.float32(hf_cfg.rms_norm_eps)  # GGUF keeps eps as a float32
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert set(weights) == set(hf_weights)
    for name, w in hf_weights.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)
    assert_matches_hf(load_backend(cfg, weights), hf, cfg.vocab_size, n_tokens=1)


HF = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def test_qwen3_config_follows_transformers_defaults_and_window_rules():
    d = definition("qwen3")
    assert d.config_from_hf(HF).head_dim == 128  # Qwen3Config's default, not hidden / heads
    assert d.config_from_hf({**HF, "head_dim": 32}).head_dim == 32
    # a window only with use_sliding_window; then from max_window_layers on unless layer_types says
    assert d.config_from_hf({**HF, "sliding_window": 16}).sliding_window is None
    cfg = d.config_from_hf({**HF, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2})
    assert [cfg.layer_window(i) for i in range(4)] == [None, None, 16, 16]
    types = ["sliding_attention", "full_attention"] * 2
    cfg = d.config_from_hf({**HF, "use_sliding_window": True, "sliding_window": 16, "layer_types": types})
    assert [cfg.layer_window(i) for i in range(4)] == [16, None, 16, None]
    cfg = d.config_from_hf({**HF, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4})
    assert cfg.sliding_window is None and cfg.layer_types == ()  # no layer slides


def test_qwen3_refuses_what_it_does_not_support():
    d = definition("qwen3")
    with pytest.raises(ValueError, match="qwen3: hidden_act 'gelu' is not supported"):
        d.config_from_hf({**HF, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="qwen3: layer_types .*'chunked_attention'"):
        d.config_from_hf({**HF, "use_sliding_window": True, "sliding_window": 8,
                          "layer_types": ["chunked_attention"] * 4})  # fmt: skip
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
            "qwen3.feed_forward_length": 128, "qwen3.block_count": 2, "qwen3.rope.scaling.type": "longrope"}  # fmt: skip
    with pytest.raises(ValueError, match="qwen3: qwen3.rope.scaling.type 'longrope' is not supported"):
        d.config_from_gguf(meta, set())


def test_qwen3_gguf_keeps_q_k_rows_in_hf_order(tmp_path):
    """llama.cpp converts qwen3 as qwen2 (no q/k permutation); the norms map by name."""
    d = definition("qwen3")
    cfg = d.config_from_hf({**HF, "head_dim": 32})
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    ((name, out),) = d.from_gguf(cfg, "blk.1.attn_k.weight", w)
    assert name == "model.layers.1.self_attn.k_proj.weight"
    np.testing.assert_array_equal(out, w)
    norm = np.ones(32, dtype=np.float32)
    ((name, _),) = d.from_gguf(cfg, "blk.0.attn_q_norm.weight", norm)
    assert name == "model.layers.0.self_attn.q_norm.weight"
    assert sum(n.endswith("self_attn.k_norm.weight") for n in d.tensors(cfg)) == 4


@pytest.mark.slow
def test_tiny_servable_checkpoints_load_with_the_default_tokenizer(default_gguf_path, tmp_path):
    """``tiny_qwen``'s servable directories: the default GGUF's vocabulary, template and end token,
    and a model that loads and generates."""
    from engine.chat_template import render_chat
    from engine.tokenizer import load_tokenizer
    from tests.models.tiny_qwen import write_tiny_qwen3, write_tiny_qwen3_moe

    default = load_tokenizer(default_gguf_path)
    for write, arch in ((write_tiny_qwen3, "qwen3"), (write_tiny_qwen3_moe, "qwen3_moe")):
        target = write(tmp_path / arch, default_gguf_path)
        cfg, weights = load_artifact(target)
        tok = load_tokenizer(target)
        assert cfg.arch == arch and cfg.vocab_size == tok.vocab_size == default.vocab_size
        assert tok.chat_template == default.chat_template and tok.eos_token == default.eos_token
        assert cfg.eos_token_ids == (tok.tokenizer.token_to_id(tok.eos_token),)
        prompt = render_chat(tok.chat_template, [{"role": "user", "content": "Hi"}], bos_token=tok.bos_token,
                             eos_token=tok.eos_token)  # fmt: skip
        _, tokens = greedy(load_backend(cfg, weights), tok.encode(prompt), 4, list(range(8)))
        assert len(tokens) == 4 and all(0 <= t < cfg.vocab_size for t in tokens)
