"""gpt-oss on the numpy backend against transformers (torch, float32) on the same weights.

A tiny random checkpoint (tests/models/tiny_gpt_oss.py): 4 layers alternating a window of 8
and full attention, sinks, yarn rope, 4 biased experts choosing 2 with the clamped SwiGLU.
Prompts run past the window. Also: the yarn tables, MXFP4 dequantization bit for bit against
transformers' own, an MXFP4 checkpoint, llama.cpp's GGUF layout, and refused config fields.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.loaders import load_artifact
from engine.loaders.hf import config_from_hf
from engine.loaders.mxfp4 import dequantize_hf
from engine.model_config import ModelConfig
from engine.models import definition
from engine.models.ops import MoE, Rope
from engine.models.rope import rope_tables
from tests.engine.test_hf_parity import MAX_REL_ERR, greedy, hf_greedy, load_backend, rel_err
from tests.models.tiny_gpt_oss import quantize_experts_mxfp4, write_checkpoint, write_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's cores are shared; one thread is several times faster here
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "hf")


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_matches_hf(path, lengths=(3, 17, 40)) -> None:
    cfg, weights = load_artifact(path)
    backend, hf = load_backend(cfg, weights), _hf(path)
    rng = np.random.default_rng(1)
    for n in lengths:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        ours, our_tokens = greedy(backend, ids, 32, list(range(8)))
        theirs, their_tokens = hf_greedy(hf, ids, 32)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, n
        assert our_tokens == their_tokens, n


def test_config_and_blocks(tiny):
    cfg, weights = load_artifact(tiny)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("gpt_oss", 4, 2, 32)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 8
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    d = definition("gpt_oss")
    assert set(weights) == set(d.tensors(cfg))
    assert [d.block(cfg, i).attention.sliding_window for i in range(4)] == [8, None, 8, None]
    block = d.block(cfg, 0)
    assert block.attention.sinks and block.attention.o_bias and block.attention.qkv_bias
    assert block.mlp == MoE(4, 2, True, router_bias=True, expert_bias=True, act="swiglu_oai", swiglu_limit=1.5)


@pytest.mark.slow
def test_logits_and_greedy_match_hf(tiny):
    _assert_matches_hf(tiny)


@pytest.mark.parametrize("truncate", [True, False, None])
@pytest.mark.parametrize("extra", [{}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"attention_factor": 1.3}])
def test_yarn_tables_match_hf(truncate, extra):
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, **extra}  # fmt: skip
    if truncate is not None:
        rope["truncate"] = truncate
    hf_cfg = transformers.GptOssConfig(head_dim=64, rope_parameters={**rope, "rope_theta": 150000.0})
    inv, factor = _compute_yarn_parameters(hf_cfg)
    cfg = ModelConfig(arch="gpt_oss", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=64, rope_theta=150000.0, rope_scaling=rope, max_position=131072)  # fmt: skip
    ours, our_factor = rope_tables(cfg, Rope())
    np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6)
    assert our_factor == pytest.approx(factor, rel=1e-12)
    assert rope_tables(cfg, Rope(scaled=False))[1] == 1.0


@pytest.mark.parametrize("scales", [(0, 256), (110, 135)])
def test_mxfp4_dequantize_is_transformers_bit_for_bit(scales):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)  # every nibble, both orders
    s = rng.integers(*scales, (3, 40, 2), dtype=np.uint8)  # the full range includes 255 (inf) and 0
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(s), dtype=torch.float32).numpy()
    ours = dequantize_hf(blocks, s)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (3, 64, 40)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.fixture(scope="module")
def tiny_mxfp4(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "hf")
    quantize_experts_mxfp4(path)
    return path


@pytest.mark.slow
def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tiny_mxfp4):
    _, weights = load_artifact(tiny_mxfp4)
    hf = _hf(tiny_mxfp4)
    for i, layer in enumerate(hf.model.layers):
        gate_up, down = layer.mlp.experts.gate_up_proj.detach().numpy(), layer.mlp.experts.down_proj.detach().numpy()
        for e in range(4):
            p = f"model.layers.{i}.mlp.experts.{e}."
            np.testing.assert_array_equal(weights[p + "gate_proj.weight"], gate_up[e][:, 0::2].T)
            np.testing.assert_array_equal(weights[p + "up_proj.weight"], gate_up[e][:, 1::2].T)
            np.testing.assert_array_equal(weights[p + "down_proj.weight"], down[e].T)
    _assert_matches_hf(tiny_mxfp4, lengths=(20,))


# --- llama.cpp's layout --------------------------------------------------------------------


@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_gguf_loads_as_its_hf_checkpoint(mxfp4, tiny, tiny_mxfp4, tmp_path):
    """llama.cpp's names, stacked experts and metadata (MXFP4 experts in ggml's block layout) map onto
    the same canonical tensors, bit for bit, and the same config as the safetensors checkpoint."""
    hf_dir = tiny_mxfp4 if mxfp4 else tiny
    write_gguf(hf_dir, tmp_path / "tiny.gguf", mxfp4=mxfp4)
    hf_cfg, hf_weights = load_artifact(hf_dir)
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    assert cfg.rms_norm_eps == np.float32(hf_cfg.rms_norm_eps)  # GGUF keeps eps as a float32
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert cfg.params == {"swiglu_limit": 7.0}  # llama.cpp fixes the clamp at gpt-oss's 7 (params is not compared)
    assert set(weights) == set(hf_weights)
    for name, w in hf_weights.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)


# --- refused -------------------------------------------------------------------------------


def _config(tiny, **change) -> dict:
    return {**json.loads((tiny / "config.json").read_text()), **change}


def test_unsupported_fields_are_refused_by_name(tiny):
    with pytest.raises(ValueError, match=r"gpt_oss: swiglu_alpha 1\.5 is not supported"):
        config_from_hf(_config(tiny, swiglu_alpha=1.5))
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method 'gptq' is not supported"):
        config_from_hf(_config(tiny, quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type 'linear' is not supported"):
        config_from_hf(_config(tiny, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match=r"layer_types .* one of"):
        config_from_hf(_config(tiny, layer_types=["sliding_attention", "chunked_attention"] * 2))


# --- the real checkpoints' shape -------------------------------------------------------------

# openai/gpt-oss-20b's config.json (transformers 4.55 era: rope_scaling and rope_theta at the top).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
}  # fmt: skip


def test_gpt_oss_20b_config():
    cfg = config_from_hf(GPT_OSS_20B, {"eos_token_id": [200002, 199999, 200012]})
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (24, 64, 8, 64)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.sliding_window == 128 and cfg.layer_window(0) == 128 and cfg.layer_window(1) is None
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["factor"] == 32.0 and not cfg.rope_scaling["truncate"]
    assert cfg.eos_token_ids == (200002, 199999, 200012) and cfg.params == {"swiglu_limit": 7.0}
    inv, factor = rope_tables(cfg, Rope())
    assert inv.shape == (32,) and factor == pytest.approx(0.1 * np.log(32.0) + 1.0)
    shapes = definition("gpt_oss").tensors(cfg)
    assert shapes["model.layers.23.mlp.experts.31.gate_proj.weight"] == (2880, 2880)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2880)  # 64 heads of 64 > hidden
    assert shapes["model.layers.0.self_attn.o_proj.bias"] == (2880,) and shapes["model.layers.0.self_attn.sinks"] == (
        64,
    )
    total = sum(int(np.prod(s)) for s in shapes.values())
    assert 20.5e9 < total < 21.5e9  # "gpt-oss-20b": 20.9 billion parameters


def test_mxfp4_pairs_split_across_shards_are_joined():
    from engine.loaders.mxfp4 import join_pairs

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (2, 6, 1, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (2, 6, 1), dtype=np.uint8)
    halves: dict = {}
    first = join_pairs({"a.down_proj_blocks": blocks, "a.norm.weight": np.ones(3, np.float32)}, halves)
    assert set(first) == {"a.norm.weight"} and set(halves) == {"a.down_proj_blocks"}
    second = join_pairs({"a.down_proj_scales": scales}, halves)
    assert not halves and second["a.down_proj"].shape == (2, 32, 6)
    np.testing.assert_array_equal(second["a.down_proj"], dequantize_hf(blocks, scales))
