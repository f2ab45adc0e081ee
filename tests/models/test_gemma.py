"""gemma2 and gemma3 on the numpy backend against transformers, from a Hugging Face directory and
from the same weights as llama.cpp lays them out in a GGUF; and what their parsers refuse.

The tiny checkpoints (``tests.models.tiny_gemma``) slide a window of 8 over prompts of up to 40
tokens plus 32 generated ones, so the window, the soft-caps, the query scalar and gemma3's two
ropes all change the logits (each, left out, moves them by 7% to 84%).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.loaders import artifact_format, load_artifact
from engine.models import definition, for_gguf, for_hf
from tests.engine.test_hf_parity import MAX_REL_ERR, PROMPTS, greedy, hf_greedy, load_backend, rel_err
from tests.models.tiny_gemma import HEAD_DIM, WINDOW, tiny_gemma, write_tiny_gemma2, write_tiny_gemma3

LENGTHS = (5, 19, 40)  # one inside the window, two past it
KINDS = ["gemma2", "gemma3"]


def _save(kind: str, path, **kw) -> None:
    pytest.importorskip("transformers")
    tiny_gemma(kind, **kw).save_pretrained(path)


def _assert_matches_hf(cfg, weights, hf_dir) -> None:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    backend = load_backend(cfg, weights)
    rng = np.random.default_rng(1)
    for n in LENGTHS:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        ours, our_tokens = greedy(backend, ids, 32, list(range(8)))
        theirs, their_tokens = hf_greedy(hf, ids, 32)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, n
        assert our_tokens == their_tokens, n


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_hf_checkpoint_matches_transformers(kind, tmp_path):
    _save(kind, tmp_path)
    assert artifact_format(tmp_path) == "hf"
    cfg, weights = load_artifact(tmp_path)
    assert cfg.arch == kind and cfg.tie_word_embeddings and cfg.sliding_window == WINDOW
    assert {cfg.layer_window(i) for i in range(cfg.num_layers)} == {WINDOW, None}
    assert cfg.params["query_pre_attn_scalar"] == 24.0
    if kind == "gemma3":
        assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
        assert cfg.params["rope_local_base_freq"] == 100.0 and cfg.rope_theta == 1e6
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert cfg.params["attn_logit_softcapping"] is None and cfg.params["final_logit_softcapping"] == 12.0
    else:
        assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
        assert (cfg.params["attn_logit_softcapping"], cfg.params["final_logit_softcapping"]) == (3.0, 8.0)
    assert set(weights) == set(definition(kind).tensors(cfg))
    _assert_matches_hf(cfg, weights, tmp_path)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
}  # fmt: skip


def _write_gguf(kind: str, hf_dir, path) -> None:
    """The checkpoint as llama.cpp's converter writes it: its keys, its names, 1 + w in every norm."""
    import gguf

    from engine.loaders.hf import read_safetensors

    hf = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), kind)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
    else:  # the global rope only: llama.cpp assumes the local one
        full = hf["rope_parameters"]["full_attention"]
        writer.add_rope_dimension_count(hf["head_dim"])
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    for name, w in read_safetensors(hf_dir / "model.safetensors").items():
        if name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if name.startswith("model.layers."):
            _, _, i, suffix = name.split(".", 3)
            writer.add_tensor(f"blk.{i}.{_GGUF_NAMES[suffix]}", w)
        else:
            writer.add_tensor(_GGUF_NAMES[name], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_gguf_matches_its_hf_checkpoint_and_transformers(kind, tmp_path):
    """The values llama.cpp hard-codes (query_pre_attn_scalar, the sliding pattern, gemma3's local
    rope base) match the checkpoint's, so the GGUF must load as the same model."""
    _save(kind, tmp_path / "hf", llama_cpp=True)
    _write_gguf(kind, tmp_path / "hf", tmp_path / "tiny.gguf")
    hf_cfg, hf_weights = load_artifact(tmp_path / "hf")
    cfg, weights = load_artifact(tmp_path / "tiny.gguf")
    assert cfg.rms_norm_eps == np.float32(hf_cfg.rms_norm_eps)  # GGUF keeps eps as a float32
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert cfg.params == hf_cfg.params and cfg.params["query_pre_attn_scalar"] == HEAD_DIM
    assert set(weights) == set(hf_weights)
    for name, w in hf_weights.items():  # (w + 1) - 1 rounds once, within float32 of 1
        np.testing.assert_allclose(weights[name], w, rtol=0, atol=1e-7 if "norm" in name else 0, err_msg=name)
    _assert_matches_hf(cfg, weights, tmp_path / "hf")


@pytest.mark.slow
def test_multimodal_gemma3_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory: text_config and the language model's weights;
    the vision tower and projector are never loaded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text = tiny_gemma("gemma3", final_logit_softcapping=None).config  # the multimodal head has none
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    capped = {**json.loads((tmp_path / "config.json").read_text()), "model_type": "gemma3"}
    capped["text_config"] = {**capped["text_config"], "final_logit_softcapping": 30.0}
    with pytest.raises(ValueError, match="gemma3: text_config.final_logit_softcapping is not supported"):
        for_hf("gemma3").config_from_hf(capped)
    ours, weights = load_artifact(tmp_path)
    assert ours.arch == "gemma3" and ours.num_layers == 7 and ours.params["rope_local_base_freq"] == 100.0
    assert set(weights) == set(definition("gemma3").tensors(ours))
    ids = np.random.default_rng(4).integers(0, ours.vocab_size, 30).tolist()
    logits, _ = greedy(load_backend(ours, weights), ids, 1, list(range(8)))
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, -1].numpy()
    assert rel_err(logits, theirs) <= MAX_REL_ERR


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_servable_dirs_match_transformers_on_text_prompts(kind, tmp_path, default_gguf_path):
    """``write_tiny_gemma2`` / ``write_tiny_gemma3``: the default GGUF's tokenizer and chat template
    beside the weights; the harness's text prompts through it (the first for 32 greedy tokens)."""
    import torch
    import transformers

    from engine.tokenizer import load_tokenizer

    write = write_tiny_gemma2 if kind == "gemma2" else write_tiny_gemma3
    write(tmp_path, default_gguf_path)
    tok, default = load_tokenizer(tmp_path), load_tokenizer(default_gguf_path)
    assert tok.chat_template == default.chat_template and tok.eos_token == default.eos_token
    cfg, weights = load_artifact(tmp_path)
    assert cfg.arch == kind and cfg.vocab_size == tok.vocab_size and cfg.eos_token_ids == (2,)
    backend = load_backend(cfg, weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        n = 32 if i == 0 else 1
        ours, our_tokens = greedy(backend, ids, n, list(range(8)))
        theirs, their_tokens = hf_greedy(hf, ids, n)
        assert rel_err(ours, theirs) <= MAX_REL_ERR, prompt
        assert our_tokens == their_tokens, prompt


# --- what the parsers refuse, and llama.cpp's hard-coded rules ------------------------------

HF = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


@pytest.mark.parametrize(
    "kind, extra, message",
    [
        ("gemma2", {"hidden_activation": "gelu"}, "gemma2: hidden_activation 'gelu' is not supported"),
        ("gemma2", {"use_bidirectional_attention": True}, "gemma2: use_bidirectional_attention"),
        ("gemma2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "gemma2: rope_scaling 'yarn'"),
        ("gemma2", {"layer_types": ["sliding_attention"] * 3}, "layer_types .* is not supported"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "gemma3: attn_logit_softcapping"),
        (
            "gemma3_text",
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "gemma3: rope scaling on the sliding layers",
        ),
        ("gemma3_text", {"layer_types": ["chunked_attention"] * 4}, "layer_types .* is not supported"),
    ],
)
def test_unsupported_hf_fields_are_refused_by_name(kind, extra, message):
    with pytest.raises(ValueError, match=message):
        for_hf(kind).config_from_hf({"model_type": kind, **HF, **extra})


def _meta(arch: str, layers: int, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 2,
            f"{arch}.attention.key_length": 16, f"{arch}.feed_forward_length": 128, f"{arch}.block_count": layers,
            **{f"{arch}.{k}": v for k, v in extra.items()}}  # fmt: skip


def test_gguf_follows_llama_cpps_hard_coded_rules():
    g2 = for_gguf("gemma2").config_from_gguf(_meta("gemma2", 4), set())
    assert g2.sliding_window == 4096 and g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (g2.params["attn_logit_softcapping"], g2.params["final_logit_softcapping"]) == (50.0, 30.0)
    assert g2.params["query_pre_attn_scalar"] == 16  # head_dim ...
    assert for_gguf("gemma2").config_from_gguf(_meta("gemma2", 46), set()).params["query_pre_attn_scalar"] == 32
    assert for_gguf("gemma3").config_from_gguf(_meta("gemma3", 62), set()).params["query_pre_attn_scalar"] == 32
    g3 = for_gguf("gemma3").config_from_gguf(_meta("gemma3", 7, **{"attention.sliding_window": 512}), set())
    assert g3.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert g3.params["rope_local_base_freq"] == 10000.0 and g3.params["final_logit_softcapping"] is None
    no_window = for_gguf("gemma3").config_from_gguf(_meta("gemma3", 7), set())
    assert no_window.sliding_window is None and set(no_window.layer_types) == {"full_attention"}
    with pytest.raises(ValueError, match=r"gemma3: gemma3.attn_logit_softcapping is not supported"):
        for_gguf("gemma3").config_from_gguf(_meta("gemma3", 7, attn_logit_softcapping=50.0), set())
    with pytest.raises(ValueError, match=r"gemma2: gemma2.rope.scaling.type 'yarn' is not supported"):
        for_gguf("gemma2").config_from_gguf(_meta("gemma2", 4, **{"rope.scaling.type": "yarn"}), set())


def test_gguf_norm_weights_lose_llama_cpps_added_one():
    cfg = for_gguf("gemma3").config_from_gguf(_meta("gemma3", 7), set())
    w = np.array([0.5, 1.0, 1.25], dtype=np.float32)
    for gguf_name, canonical in [("blk.3.post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
                                 ("blk.3.attn_k_norm.weight", "self_attn.k_norm.weight")]:  # fmt: skip
        ((name, out),) = definition("gemma3").from_gguf(cfg, gguf_name, w)
        assert name == f"model.layers.3.{canonical}"
        np.testing.assert_array_equal(out, w - 1)
    ((_, q),) = definition("gemma3").from_gguf(cfg, "blk.0.attn_q.weight", np.eye(32, 64, dtype=np.float32))
    np.testing.assert_array_equal(q, np.eye(32, 64))  # NEOX rope: rows stay in HF order
