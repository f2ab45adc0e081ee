"""Hugging Face model directories: config.json plus (sharded) safetensors.

Covers llama, mistral and qwen2 (q/k/v biases, tied embeddings, rope_theta,
llama3 ``rope_scaling``, an explicit ``head_dim``). Weights come back as float32
in HF naming and ``[out, in]`` layout, unchanged.

``safetensors.numpy`` cannot produce bfloat16 arrays, so bf16 tensors are read
raw from the file (the header gives each tensor's byte range) and widened with
a uint16 -> float32 shift: bf16 is the top half of an IEEE float32.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.model_config import ModelConfig, weight_names

SUPPORTED_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def config_from_hf(cfg: dict, generation: dict | None = None) -> ModelConfig:
    """``ModelConfig`` from a parsed config.json (and generation_config.json if present)."""
    arch = cfg.get("model_type", "llama")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {arch!r} (supported: {sorted(SUPPORTED_ARCHS)})")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    # transformers 5 keeps rope_theta under rope_parameters; older configs have it at the top.
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        max_position=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as a float32 numpy array."""
    from safetensors import safe_open

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    raw_names = []
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] == "BF16":
            raw_names.append(name)
    if len(raw_names) < len(header) - ("__metadata__" in header):
        with safe_open(str(path), framework="numpy") as st:
            for name in st.keys():
                if name not in raw_names:
                    out[name] = np.asarray(st.get_tensor(name), dtype=np.float32)
    if raw_names:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for name in raw_names:
            start, end = header[name]["data_offsets"]
            bits = np.frombuffer(mm[base + start : base + end].tobytes(), dtype="<u2")
            out[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(header[name]["shape"])
        del mm
    return out


def load_hf(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face directory; ``progress(done, total)`` counts safetensors files."""
    root = Path(path)
    cfg_json = json.loads((root / "config.json").read_text())
    gen_path = root / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {root}")
    weights: dict[str, np.ndarray] = {}
    for done, name in enumerate(files, 1):
        weights.update(read_safetensors(root / name))
        if progress:
            progress(done, len(files))
    cfg = config_from_hf(cfg_json, generation)
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        # Some checkpoints drop the head while config says untied; the head is the embedding then.
        import dataclasses

        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    missing = [n for n in weight_names(cfg) if n not in weights]
    if missing:
        raise ValueError(f"{root}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    return cfg, weights
