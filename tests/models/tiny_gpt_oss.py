"""Tiny random gpt-oss checkpoints written by transformers, for parity tests and end-to-end serving.

``write_checkpoint`` is the model alone (any vocabulary); ``write_tiny_gpt_oss`` adds the
default GGUF's tokenizer and chat template, as ``tests/models/tiny.py`` does for llama, so the
server can load and serve it (``harmony=True``: with harmony's special tokens added to that
tokenizer and ``HARMONY_TEMPLATE``, so the server treats it as gpt-oss: harmony split, stops). ``quantize_experts_mxfp4`` turns a written checkpoint's experts
into MXFP4 blocks and scales (random bytes: the float weights are replaced, not rounded), the
way real gpt-oss checkpoints store them; ``write_gguf`` writes a checkpoint as llama.cpp's
converter does (MXFP4 experts in ggml's blocks, ``ggml_mxfp4``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# 4 layers alternating sliding (window 8) and full, 4 experts of 32 a token choosing 2,
# head_dim 16, yarn; a low swiglu_limit so the clamps bite on random weights.
TINY = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
    initializer_range=0.2, swiglu_limit=1.5,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
)  # fmt: skip


HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# A minimal harmony chat template (gpt-oss's own also renders tools, developer instructions and
# past reasoning): each message a header and a body; the generation prompt opens an assistant message.
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def harmony_tokenizer(default_gguf: Path):
    """The default GGUF's tokenizer bundle with harmony's markers added as special tokens."""
    from tokenizers import AddedToken

    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    bundle.tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    return bundle


def write_checkpoint(target: Path, *, vocab_size: int = 256, seed: int = 0, **overrides) -> Path:
    """A random ``GptOssForCausalLM`` saved with ``save_pretrained`` (float32); every bias random."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(vocab_size=vocab_size, **{**TINY, **overrides}))
    with torch.no_grad():  # transformers zeroes these; zeros would hide a missing bias add
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.2)
            layer.self_attn.o_proj.bias.normal_(0, 0.2)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    (target / "generation_config.json").unlink(missing_ok=True)
    return target


def quantize_experts_mxfp4(target: Path, *, seed: int = 0, scales: tuple[int, int] = (118, 127)) -> None:
    """Replace the checkpoint's fused expert weights by random MXFP4 ``_blocks`` / ``_scales``
    (``[E, out, in / 32, 16]`` / ``[E, out, in / 32]``, rows the output features as gpt-oss stores
    them) and declare ``quantization_config.quant_method: mxfp4`` in config.json."""
    from safetensors.numpy import load_file, save_file

    path = target / "model.safetensors"
    tensors = load_file(path)
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors.pop(name).shape
        tensors[name + "_blocks"] = rng.integers(0, 256, (experts, n_out, n_in // 32, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(*scales, (experts, n_out, n_in // 32), dtype=np.uint8)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config, indent=2))


def _e2m1_nibbles(blocks: np.ndarray) -> np.ndarray:
    """Each value's 4-bit code, in order: byte j of an HF block holds value 2j low, 2j + 1 high."""
    return np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The same MXFP4 data as ggml blocks: the scale byte, then 16 bytes holding value j low, j + 16 high."""
    n = _e2m1_nibbles(blocks)
    qs = (n[..., :16] | (n[..., 16:] << 4)).astype(np.uint8)
    packed = np.concatenate([scales[..., None], qs], axis=-1)  # [E, out, G, 17]
    return packed.reshape(*packed.shape[:2], -1)


def write_gguf(hf_dir, path, *, mxfp4: bool = False) -> None:
    """The checkpoint as llama.cpp's converter writes gpt-oss: F32 tensors (experts MXFP4 when the
    checkpoint's are), experts stacked [E, out, in] with gate and up apart."""
    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    rope = hf["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_expert_feed_forward_length(hf["intermediate_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_expert_count(hf["num_local_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_sliding_window(hf["sliding_window"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}  # fmt: skip
    for x, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        names |= {f"self_attn.{x}_proj.weight": f"{g}.weight", f"self_attn.{x}_proj.bias": f"{g}.bias"}
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    tensors = load_file(hf_dir / "model.safetensors")
    for name, t in tensors.items():
        if not name.startswith("model.layers."):
            w.add_tensor(globals_[name], t)
            continue
        _, _, i, suffix = name.split(".", 3)
        blk = f"blk.{i}."
        if suffix == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(blk + "ffn_gate_exps.bias", np.ascontiguousarray(t[:, 0::2]))
            w.add_tensor(blk + "ffn_up_exps.bias", np.ascontiguousarray(t[:, 1::2]))
        elif suffix == "mlp.experts.down_proj_bias":
            w.add_tensor(blk + "ffn_down_exps.bias", t)
        elif suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # [E, in, out] -> [E, out, in]
            t = t.transpose(0, 2, 1)
            if suffix.endswith("down_proj"):
                w.add_tensor(blk + "ffn_down_exps.weight", np.ascontiguousarray(t))
            else:
                w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(t[:, 0::2]))
                w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(t[:, 1::2]))
        elif suffix.endswith("_scales"):
            continue  # written with their blocks
        elif suffix.endswith("_blocks"):
            b, s = t, tensors[name.replace("_blocks", "_scales")]
            if suffix.startswith("mlp.experts.down_proj"):
                w.add_tensor(blk + "ffn_down_exps.weight", ggml_mxfp4(b, s), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            else:
                for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    w.add_tensor(blk + f"ffn_{part}_exps.weight", ggml_mxfp4(b[:, rows], s[:, rows]),
                                 raw_dtype=gguf.GGMLQuantizationType.MXFP4)  # fmt: skip
        else:
            w.add_tensor(blk + names[suffix], t)
    assert mxfp4 == any(n.endswith("_blocks") for n in tensors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gpt_oss(target: Path, default_gguf: Path, *, seed: int = 0, harmony: bool = False) -> Path:
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json in ``target``: the
    tiny gpt-oss over the default GGUF's vocabulary, with its tokenizer and chat template (or, with
    ``harmony``, harmony's tokens and template)."""
    from engine.tokenizer import load_tokenizer

    bundle = harmony_tokenizer(default_gguf) if harmony else load_tokenizer(default_gguf)
    template = HARMONY_TEMPLATE if harmony else bundle.chat_template
    eos = "<|return|>" if harmony else bundle.eos_token
    write_checkpoint(
        target, vocab_size=bundle.vocab_size, seed=seed, bos_token_id=bundle.bos_token_id,
        eos_token_id=bundle.tokenizer.token_to_id(eos) if eos else None,
    )  # fmt: skip
    bundle.tokenizer.save(str(target / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": bundle.bos_token, "eos_token": eos}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target
