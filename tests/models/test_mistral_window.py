"""mistral with ``sliding_window`` against transformers: every layer slides (window 8, prompts of
20-40 tokens, 32 tokens decoded past it), from the safetensors checkpoint and from a GGUF written
the way llama.cpp writes a Mistral (its ``llama`` architecture, q/k rows permuted)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.loaders import load_artifact
from engine.models import definition
from tests.engine.test_hf_parity import MAX_REL_ERR, greedy, hf_greedy, load_backend, rel_err

pytestmark = pytest.mark.slow

WINDOW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("mistral")
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(cfg)
    model.save_pretrained(path)
    return path, model.eval()


def _parity(cfg, weights, hf, lengths=(20, 29, 40)):
    backend = load_backend(cfg, weights)
    rng = np.random.default_rng(1)
    for n in lengths:
        ids = rng.integers(3, cfg.vocab_size, n).tolist()
        ours, our_tokens = greedy(backend, ids, 32, list(range(8)))
        theirs, their_tokens = hf_greedy(hf, ids, 32)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, n
        assert our_tokens == their_tokens, n


def test_every_layer_slides_as_transformers_masks(checkpoint):
    path, hf = checkpoint
    cfg, weights = load_artifact(path)
    assert cfg.arch == "mistral" and cfg.sliding_window == WINDOW and cfg.layer_types == ()
    assert all(definition("mistral").block(cfg, i).attention.sliding_window == WINDOW for i in range(2))
    _parity(cfg, weights, hf)
    # Without the window the same weights answer differently: the test sees the window.
    backend = load_backend(dataclasses.replace(cfg, sliding_window=None), weights)
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, 20).tolist()
    assert rel_err(greedy(backend, ids, 1, list(range(8)))[0], hf_greedy(hf, ids, 1)[0]) > 1e-2


def test_llama_config_has_no_window_and_a_window_that_never_masks_is_dropped():
    base = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
            "num_attention_heads": 4, "max_position_embeddings": 256}  # fmt: skip
    assert definition("llama").config_from_hf({**base, "sliding_window": 8}).sliding_window is None
    assert definition("mistral").config_from_hf({**base, "sliding_window": None}).sliding_window is None
    assert definition("mistral").config_from_hf({**base, "sliding_window": 256}).sliding_window is None
    assert definition("mistral").config_from_hf({**base, "sliding_window": 255}).sliding_window == 255


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF rotate_half pairs -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_window_key(checkpoint, tmp_path):
    """A Mistral GGUF as llama.cpp writes it (architecture ``llama``) with ``llama.attention.sliding_window``."""
    import gguf

    from engine.loaders.hf import read_safetensors

    path, hf_model = checkpoint
    hf = json.loads((path / "config.json").read_text())
    w = read_safetensors(path / "model.safetensors")
    out = tmp_path / "mistral.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_sliding_window(WINDOW)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight"}  # fmt: skip
    for name, t in w.items():
        if not name.startswith("model.layers."):
            writer.add_tensor(names[name], t)
            continue
        _, _, i, suffix = name.split(".", 3)
        if suffix == "self_attn.q_proj.weight":
            t = _permute(t, hf["num_attention_heads"])
        elif suffix == "self_attn.k_proj.weight":
            t = _permute(t, hf["num_key_value_heads"])
        short = names.get(suffix) or {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight":
            "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight":
            "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight":
            "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}[suffix]  # fmt: skip
        writer.add_tensor(f"blk.{i}.{short}", np.ascontiguousarray(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg, weights = load_artifact(out)
    assert cfg.arch == "llama" and cfg.sliding_window == WINDOW and cfg.all_layers_slide
    _parity(cfg, weights, hf_model, lengths=(25,))
