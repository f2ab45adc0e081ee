"""Tiny random-weight gemma2 / gemma3 checkpoints written by transformers.

``tiny_gemma`` builds the model the parity tests compare against (hidden 64,
head_dim 16, a sliding window of 8, both layer kinds, random norm weights so
that a missing ``1 + w`` shows); ``write_tiny_gemma2`` / ``write_tiny_gemma3``
save one with the default GGUF's tokenizer and chat template (as
``tests.models.tiny`` does for llama), so the server can load and serve it
end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

WINDOW = 8
HEAD_DIM = 16


def tiny_gemma(kind: str, *, vocab_size: int = 256, seed: int = 0, llama_cpp: bool = False, **overrides):
    """A float32 ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (``kind`` "gemma2" / "gemma3"), in eval mode.

    ``llama_cpp``: the values llama.cpp's loader hard-codes instead of reading them from a GGUF
    (``query_pre_attn_scalar`` = head_dim, gemma3's local rope base 10000); otherwise ones that
    differ from every default, so a definition that ignores the field fails.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=HEAD_DIM, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
        sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM if llama_cpp else 24,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    if kind == "gemma2":  # layers 0 and 2 slide
        caps = dict(attn_logit_softcapping=3.0, final_logit_softcapping=8.0)
        cfg = transformers.Gemma2Config(num_hidden_layers=4, **{**common, **caps, **overrides})
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3":  # layers 0-4 and 6 slide (the pattern of 6 llama.cpp assumes)
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0 if llama_cpp else 100.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        }
        extra = dict(rope_parameters=rope, final_logit_softcapping=12.0)
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=7, **{**common, **extra, **overrides})
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # transformers starts gemma's norms at 0 (a scale of 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return model.eval()


def write_tiny_gemma2(target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """A tiny gemma2 HF directory (config, safetensors, tokenizer.json, tokenizer_config.json)."""
    return _write("gemma2", target, default_gguf, seed)


def write_tiny_gemma3(target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """A tiny gemma3 (``gemma3_text``) HF directory, laid out as ``write_tiny_gemma2``'s."""
    return _write("gemma3", target, default_gguf, seed)


def _write(kind: str, target: Path, default_gguf: Path, seed: int) -> Path:
    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    # The default GGUF's ids (SmolLM2: <|im_start|> 1, <|im_end|> 2), as tests.models.tiny uses.
    model = tiny_gemma(
        kind, vocab_size=bundle.tokenizer.get_vocab_size(), seed=seed, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=2048,
    )  # fmt: skip
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    bundle.tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": bundle.chat_template, "bos_token": bundle.bos_token, "eos_token": bundle.eos_token}
        )
    )
    (target / "generation_config.json").unlink(missing_ok=True)
    return target
