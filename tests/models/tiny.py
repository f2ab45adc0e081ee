"""A second real model for switch tests: a tiny random-weight llama checkpoint in HF layout,
with the default GGUF's tokenizer and chat template (so both models share a vocabulary)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def write_tiny_llama(target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``target``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=bundle.tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    target.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(target, safe_serialization=True)
    bundle.tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": bundle.chat_template,
                "bos_token": bundle.bos_token,
                "eos_token": bundle.eos_token,
            }
        )
    )
    for extra in ("generation_config.json",):
        (target / extra).unlink(missing_ok=True)
    return target


def link_default_gguf(models_dir: Path, default_gguf: Path) -> Path:
    """The default GGUF inside ``models_dir`` (a hard link when the disk allows: no symlink escapes)."""
    dest = models_dir / "smollm2-135m-instruct" / default_gguf.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        try:
            os.link(default_gguf, dest)
        except OSError:
            shutil.copy2(default_gguf, dest)
    return dest


_CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / f"ignis-tiny-llama-{os.getuid()}"


def models_dir_with_two(models_dir: Path, default_gguf: Path, *extra_tiny: str) -> Path:
    """A models directory holding the default GGUF and ``tiny-llama`` (plus copies named ``extra_tiny``)."""
    if not (_CACHE / "model.safetensors").exists():
        tmp = _CACHE.with_name(_CACHE.name + f".{os.getpid()}")
        write_tiny_llama(tmp, default_gguf)
        shutil.rmtree(_CACHE, ignore_errors=True)
        tmp.rename(_CACHE)
    link_default_gguf(models_dir, default_gguf)
    for name in ("tiny-llama", *extra_tiny):
        shutil.copytree(_CACHE, models_dir / name, dirs_exist_ok=True)
    return models_dir
