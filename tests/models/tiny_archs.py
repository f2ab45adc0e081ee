"""A tiny servable checkpoint of every architecture, for the end-to-end tests.

Each is a random model of transformers' own class for that architecture (``save_pretrained``),
with the default GGUF's tokenizer and chat template beside it (tests/models/tiny.py's recipe), so
the server loads it through ``--model-path`` / an implicit switch and renders text with it.
"""

from __future__ import annotations

import json
from pathlib import Path

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=2048, initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
ARCHS = ("qwen3", "qwen3_moe", "mixtral", "mistral", "phi3", "gemma2", "gemma3", "gpt_oss")


def _model(arch: str, vocab: int):
    import transformers as tf

    base = dict(SMALL, vocab_size=vocab)
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(num_hidden_layers=2, **rope, **base))
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=32, **rope, **base))  # fmt: skip
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4, **base))
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=2, sliding_window=16, **base))
    if arch == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(num_hidden_layers=2, sliding_window=None,
                                                **{k: v for k, v in base.items() if k != "head_dim"}))  # fmt: skip
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(num_hidden_layers=2, sliding_window=16, **base))
    if arch == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(num_hidden_layers=2, sliding_window=16, **base))
    if arch == "gpt_oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(num_hidden_layers=2, sliding_window=16, num_local_experts=4,
                                                    num_experts_per_tok=2, **{**base, "intermediate_size": 32}))  # fmt: skip
    raise ValueError(arch)


def write_tiny(arch: str, target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """``target`` as a servable HF directory of a random ``arch`` model."""
    import torch

    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    torch.manual_seed(seed)
    model = _model(arch, bundle.tokenizer.get_vocab_size())
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    bundle.tokenizer.save(str(target / "tokenizer.json"))
    config = {"chat_template": bundle.chat_template, "bos_token": bundle.bos_token, "eos_token": bundle.eos_token}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target
