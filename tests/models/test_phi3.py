"""phi3 (Phi-3 / Phi-4 dense) against transformers: longrope's two factor sets, partial rotary,
the sliding window, and llama.cpp's longrope GGUF layout (factor tensors)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from engine.loaders import load_artifact
from engine.models import definition
from engine.models.ops import Rope
from engine.models.rope import rope_tables
from tests.engine.test_hf_parity import MAX_REL_ERR, greedy, hf_greedy, load_backend, rel_err

pytestmark = pytest.mark.slow

ORIGINAL = 64  # original_max_position_embeddings; max_position_embeddings is 256
HEAD_DIM = 16


def _factors(pairs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "type": "longrope",
        "short_factor": (1.0 + 0.5 * rng.random(pairs)).round(4).tolist(),
        "long_factor": (1.0 + 8.0 * rng.random(pairs)).round(4).tolist(),
    }


def _phi3(path, **kw):
    """A tiny random Phi3ForCausalLM saved to ``path``; returns the model (float32, eval)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw,
    )  # fmt: skip
    model = transformers.Phi3ForCausalLM(cfg)
    model.save_pretrained(path)
    return model.eval()


def _assert_parity(cfg, weights, hf, lengths, n=32):
    backend = load_backend(cfg, weights)
    rng = np.random.default_rng(1)
    for length in lengths:
        ids = rng.integers(3, cfg.vocab_size, length).tolist()
        ours, our_tokens = greedy(backend, ids, n, list(range(16)))
        theirs, their_tokens = hf_greedy(hf, ids, n)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, length
        assert our_tokens == their_tokens, length


def test_longrope_long_factors_past_the_original_window(tmp_path):
    """Served context 256 > original 64: long factors and transformers' attention factor; prompts
    longer than the original window, where transformers uses the long factors too."""
    hf = _phi3(tmp_path, rope_scaling=_factors(HEAD_DIM // 2, 0))
    cfg, weights = load_artifact(tmp_path)
    rs = cfg.rope_scaling
    assert rs["rope_type"] == "longrope" and rs["original_max_position_embeddings"] == ORIGINAL
    inv, factor = rope_tables(cfg, Rope())
    assert factor == pytest.approx(math.sqrt(1 + math.log(256 / ORIGINAL) / math.log(ORIGINAL)))
    assert factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    _assert_parity(cfg, weights, hf, (70, 90))
    # The other set is measurably wrong here: the test can tell them apart.
    short = dataclasses.replace(cfg, rope_scaling={**rs, "long_factor": rs["short_factor"]})
    backend = load_backend(short, weights)
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, 70).tolist()
    assert rel_err(greedy(backend, ids, 1, list(range(16)))[0], hf_greedy(hf, ids, 1)[0]) > 1e-3


def test_longrope_short_factors_within_the_original_window(tmp_path):
    """A load serving at most the original window (max_position clamped to it) uses the short
    factors, with the checkpoint's attention factor all the same: transformers on sequences that
    stay inside the window."""
    hf = _phi3(tmp_path, rope_scaling=_factors(HEAD_DIM // 2, 0))
    cfg, weights = load_artifact(tmp_path)
    served = dataclasses.replace(cfg, max_position=ORIGINAL)
    inv, factor = rope_tables(served, Rope())
    assert factor == pytest.approx(hf.model.rotary_emb.attention_scaling) and factor > 1.0
    np.testing.assert_array_equal(inv, hf.model.rotary_emb.original_inv_freq.numpy())
    _assert_parity(served, weights, hf, (12, 30))  # 30 + 32 decoded < 64


def test_partial_rotary_with_longrope(tmp_path):
    """Phi-4-mini's shape: rope over 3/4 of each head (12 of 16 dims), longrope over those 6 pairs."""
    hf = _phi3(tmp_path, partial_rotary_factor=0.75, rope_scaling=_factors(6, 2))
    cfg, weights = load_artifact(tmp_path)
    assert cfg.params["rotary_dim"] == 12
    assert definition("phi3").block(cfg, 0).attention.rope == Rope(rotary_dim=12)
    assert len(rope_tables(cfg, Rope(rotary_dim=12))[0]) == 6
    _assert_parity(cfg, weights, hf, (70,))


def test_partial_rotary_without_scaling(tmp_path):
    hf = _phi3(tmp_path, partial_rotary_factor=0.5)
    cfg, weights = load_artifact(tmp_path)
    assert cfg.rope_scaling is None and cfg.params["rotary_dim"] == 8
    _assert_parity(cfg, weights, hf, (5, 40))


def test_sliding_window_slides_every_layer(tmp_path):
    """Phi-3-mini-4k's sliding_window is real windowed attention in transformers: so it is here
    (window 8, prompts past it, 32 tokens decoded further past it)."""
    hf = _phi3(tmp_path, sliding_window=8)
    cfg, weights = load_artifact(tmp_path)
    assert cfg.sliding_window == 8 and cfg.layer_types == () and cfg.all_layers_slide
    assert cfg.max_position == 256  # no longer capped at the window
    _assert_parity(cfg, weights, hf, (20, 37))


def _write_gguf(hf_dir, path) -> None:
    """The checkpoint as llama.cpp's converter writes a longrope phi3: fused tensors, F32, the
    factors as rope_factors_{long,short} tensors and the longrope metadata keys."""
    import gguf

    from engine.loaders.hf import read_safetensors

    hf = json.loads((hf_dir / "config.json").read_text())
    rope = hf["rope_parameters"]
    rotary = int(hf["hidden_size"] // hf["num_attention_heads"] * rope.get("partial_rotary_factor", 1.0))
    scale = hf["max_position_embeddings"] / hf["original_max_position_embeddings"]
    w = read_safetensors(hf_dir / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(hf["original_max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(0)  # llama.cpp's "none" (Phi-4)
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(hf["original_max_position_embeddings"]))
    )
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
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_longrope_gguf_with_factor_tensors(tmp_path):
    """llama.cpp's longrope phi3 GGUF (partial rotary too) loads to the HF checkpoint's factors and
    runs as transformers does."""
    hf = _phi3(tmp_path / "hf", partial_rotary_factor=0.75, rope_scaling=_factors(6, 3))
    _write_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    hf_cfg, _ = load_artifact(tmp_path / "hf")
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    rs = cfg.rope_scaling
    assert rs["rope_type"] == "longrope" and rs["original_max_position_embeddings"] == ORIGINAL
    np.testing.assert_array_equal(rs["long_factor"], np.float32(hf_cfg.rope_scaling["long_factor"]))
    np.testing.assert_array_equal(rs["short_factor"], np.float32(hf_cfg.rope_scaling["short_factor"]))
    assert cfg.params["rotary_dim"] == 12 and cfg.sliding_window is None
    rope = Rope(rotary_dim=12)
    np.testing.assert_array_equal(rope_tables(cfg, rope)[0], rope_tables(hf_cfg, rope)[0])
    assert rope_tables(cfg, rope)[1] == pytest.approx(rope_tables(hf_cfg, rope)[1], rel=1e-7)
    _assert_parity(cfg, weights, hf, (70,))


def test_refusals_name_the_field():
    d = definition("phi3")
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=256, original_max_position_embeddings=64)  # fmt: skip
    with pytest.raises(ValueError, match="phi3: rope_scaling 'dynamic' is not supported"):
        d.config_from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="phi3: rope_scaling longrope lacks long_factor"):
        d.config_from_hf({**base, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8}})
    with pytest.raises(ValueError, match="phi3: partial_rotary_factor 1.5"):
        d.config_from_hf({**base, "partial_rotary_factor": 1.5})
    su = d.config_from_hf({**base, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}})
    assert su.rope_scaling["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="long_factor has 7 entries, the rope has 8 pairs"):
        rope_tables(su, Rope())
