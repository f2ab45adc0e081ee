"""Model definitions: each registered architecture describes its block and tensors; the
registry and the config parsers refuse what no definition covers, saying what is supported."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.numpy.forward import check_supported
from engine.loaders.hf import config_from_hf
from engine.model_config import ModelConfig
from engine.models import DEFINITIONS, definition, for_gguf, for_hf
from engine.models.ops import Attention, Block, GatedMLP, Head, MoE, RMSNorm

HF = {
    "vocab_size": 320, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "head_dim": 16, "tie_word_embeddings": False,  # gemma's defaults are 256 and tied
}  # fmt: skip


def config(arch: str, **extra) -> ModelConfig:
    return definition(arch).config_from_hf({"model_type": arch, **HF, **extra})


# Llama-like definitions (qwen3_moe and mixtral sparse); gpt_oss (sinks) is covered by tests/models/test_gpt_oss.py,
# qwen2_5_vl (a vision tower and mrope sections in its config) by tests/models/test_qwen2_5_vl.py.
@pytest.mark.parametrize("arch", sorted(a for a in DEFINITIONS if a not in ("gpt_oss", "qwen2_5_vl")))
def test_each_definition_describes_its_block_and_tensors(arch):
    d = definition(arch)
    assert for_hf(arch) is d and all(for_gguf(a) is d for a in d.gguf_archs)
    cfg = config(arch)
    assert cfg.arch == arch and cfg.head_dim == 16
    block, head = d.block(cfg, 0), d.head(cfg)
    assert isinstance(block, Block) and isinstance(head, Head)
    assert isinstance(block.attn_norm, RMSNorm) and isinstance(block.mlp_norm, RMSNorm)
    assert isinstance(block.attention, Attention) and isinstance(block.mlp, GatedMLP | MoE)
    assert block.attention.qkv_bias == (arch == "qwen2")
    check_supported(d.blocks(cfg), head)  # the numpy backend has a reference for every operation named

    shapes = d.tensors(cfg)
    assert shapes["model.embed_tokens.weight"] == (320, 96) and shapes["lm_head.weight"] == (320, 96)
    p = "model.layers.2."
    assert shapes[p + "self_attn.q_proj.weight"] == (96, 96)  # 6 heads of 16
    assert shapes[p + "self_attn.k_proj.weight"] == shapes[p + "self_attn.v_proj.weight"] == (32, 96)
    assert shapes[p + "self_attn.o_proj.weight"] == (96, 96)
    if isinstance(d.block(cfg, 2).mlp, MoE):  # the router and each expert (tests/models/test_moe.py)
        e, width = p + "mlp.experts.0.", cfg.moe_intermediate_size
        assert shapes[p + "mlp.gate.weight"] == (cfg.num_experts, 96)
        assert shapes[e + "gate_proj.weight"] == shapes[e + "up_proj.weight"] == (width, 96)
        assert shapes[e + "down_proj.weight"] == (96, width)
    else:
        assert shapes[p + "mlp.gate_proj.weight"] == shapes[p + "mlp.up_proj.weight"] == (160, 96)
        assert shapes[p + "mlp.down_proj.weight"] == (96, 160)
    for op in (block.attn_norm, block.mlp_norm):
        assert shapes[p + op.weight + ".weight"] == (96,)
    assert shapes[head.final_norm.weight + ".weight"] == (96,)
    assert (p + "self_attn.q_proj.bias" in shapes) == block.attention.qkv_bias
    assert not any(n.startswith("model.layers.3.") for n in shapes)
    tied = d.tensors(config(arch, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied and len(tied) == len(shapes) - 1


def test_unknown_architectures_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2' \(supported: \[.*'phi3'.*'qwen2'"):
        config_from_hf({"model_type": "gpt2", **HF})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'falcon' \(supported: \[.*'llama'"):
        for_gguf("falcon")
    with pytest.raises(ValueError, match=r"unsupported architecture 'gemma'"):
        definition("gemma")


def test_phi3_splits_its_fused_tensors_into_row_views():
    d = definition("phi3")
    cfg = config("phi3")
    rng = np.random.default_rng(0)
    qkv = rng.normal(size=(96 + 32 + 32, 96)).astype(np.float32)
    gate_up = rng.normal(size=(2 * 160, 96)).astype(np.float32)
    p = "model.layers.1."
    out = d.from_hf(cfg, {p + "self_attn.qkv_proj.weight": qkv, p + "mlp.gate_up_proj.weight": gate_up})
    assert sorted(out) == sorted(p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                                                 "mlp.up_proj.weight"))  # fmt: skip
    np.testing.assert_array_equal(out[p + "self_attn.k_proj.weight"], qkv[96:128])
    np.testing.assert_array_equal(out[p + "mlp.up_proj.weight"], gate_up[160:])
    assert np.shares_memory(out[p + "self_attn.v_proj.weight"], qkv)  # a view, no copy
    with pytest.raises(ValueError, match="qkv_proj.weight: 100 rows, expected 96 \\+ 32 \\+ 32"):
        d.from_hf(cfg, {p + "self_attn.qkv_proj.weight": qkv[:100]})


def test_phi3_reads_longrope_partial_rotary_and_its_window():
    """(Parity for each is tests/models/test_phi3.py.)"""
    rs = config("phi3", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}).rope_scaling
    assert rs["rope_type"] == "longrope" and rs["long_factor"] == [2.0]
    with pytest.raises(ValueError, match="phi3: rope_scaling 'linear' is not supported"):
        config("phi3", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert config("phi3", partial_rotary_factor=0.5).params["rotary_dim"] == 8
    windowed = config("phi3", sliding_window=200)  # transformers masks every layer to the window
    assert windowed.max_position == 512 and windowed.sliding_window == 200 and windowed.all_layers_slide
    assert config("phi3", sliding_window=None).sliding_window is None
    meta = {"general.architecture": "phi3", "phi3.embedding_length": 96, "phi3.attention.head_count": 6,
            "phi3.feed_forward_length": 160, "phi3.block_count": 3, "phi3.context_length": 4096}  # fmt: skip
    with pytest.raises(ValueError, match="phi3: rope_factors tensors without phi3.rope.scaling.original_context"):
        for_gguf("phi3").config_from_gguf(meta, {"rope_factors_long.weight", "token_embd.weight"})
    with pytest.raises(ValueError, match="phi3: phi3.rope.dimension_count 18 does not fit head_dim 16"):
        for_gguf("phi3").config_from_gguf({**meta, "phi3.rope.dimension_count": 18}, set())
    gguf_cfg = for_gguf("phi3").config_from_gguf({**meta, "phi3.attention.sliding_window": 2047}, set())
    assert gguf_cfg.max_position == 4096 and gguf_cfg.sliding_window == 2047
    assert for_gguf("phi3").config_from_gguf({**meta, "phi3.attention.sliding_window": 0}, set()).sliding_window is None


def test_llama_gguf_undoes_the_q_k_row_permutation():
    """llama.cpp's converter permutes q/k rows (GPT-J pairs); qwen2 and phi3 keep HF order."""
    cfg = config("llama")
    w = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)  # k: 2 kv heads of 16 rows
    # llama.cpp's permute: rows of each head reordered as (half, pair) -> (pair, half)
    permuted = w.reshape(2, 2, 8, 3).swapaxes(1, 2).reshape(32, 3)
    ((name, out),) = definition("llama").from_gguf(cfg, "blk.0.attn_k.weight", permuted)
    assert name == "model.layers.0.self_attn.k_proj.weight"
    np.testing.assert_array_equal(out, w)
    ((_, kept),) = definition("qwen2").from_gguf(config("qwen2"), "blk.0.attn_k.weight", permuted)
    np.testing.assert_array_equal(kept, permuted)
    assert list(definition("llama").from_gguf(cfg, "blk.0.unknown.weight", w)) == []
