"""Hugging Face model directories: config.json plus (sharded) safetensors.

Generic: config.json's ``model_type`` picks the definition
(``engine.models.for_hf``), which parses the config and maps the checkpoint's
tensor names onto the canonical ones (splitting fused tensors into row views).
Weights come back as float32 in canonical naming and ``[out, in]`` layout.

``safetensors.numpy`` cannot produce bfloat16 arrays, so bf16 tensors are read
raw from the file (the header gives each tensor's byte range) and widened with
a uint16 -> float32 shift: bf16 is the top half of an IEEE float32. uint8
tensors come through raw: they are quantized data, not values. The one
quantization read is MXFP4 (``quantization_config.quant_method == "mxfp4"``,
gpt-oss's experts): each ``X_blocks`` / ``X_scales`` pair is dequantized to
float32 ``X`` before the definition maps names (``engine.loaders.mxfp4``);
any other quantization method is refused at load.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.loaders import mxfp4
from engine.model_config import ModelConfig
from engine.models import definition, for_hf

QUANT_METHODS = ("mxfp4",)  # quantization_config.quant_method values the loader dequantizes


def config_from_hf(config: dict, generation: dict | None = None) -> ModelConfig:
    """``ModelConfig`` from a parsed config.json (and generation_config.json), by its model_type's definition."""
    method = quant_method(config)
    if method is not None and method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (supported: {list(QUANT_METHODS)})"
        )
    return for_hf(config.get("model_type", "llama")).config_from_hf(config, generation)


def quant_method(config: dict) -> str | None:
    """config.json's ``quantization_config.quant_method`` (None: not quantized)."""
    return (config.get("quantization_config") or {}).get("quant_method")


def read_config(root: Path) -> ModelConfig:
    """The config of a Hugging Face directory, without reading its weights."""
    gen_path = root / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return config_from_hf(json.loads((root / "config.json").read_text()), generation)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as a float32 numpy array (uint8 ones raw)."""
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
                    t = st.get_tensor(name)
                    out[name] = t if t.dtype == np.uint8 else np.asarray(t, dtype=np.float32)
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
    cfg = read_config(root)  # first: an unsupported model_type is refused before any weights are read
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {root}")
    model = definition(cfg.arch)
    is_mxfp4 = quant_method(json.loads((root / "config.json").read_text())) == "mxfp4"
    weights: dict[str, np.ndarray] = {}
    halves: dict[str, np.ndarray] = {}  # MXFP4 blocks or scales whose partner is in a later shard
    for done, name in enumerate(files, 1):
        tensors = read_safetensors(root / name)
        if is_mxfp4:
            tensors = mxfp4.join_pairs(tensors, halves)
        weights.update(model.from_hf(cfg, tensors))
        if progress:
            progress(done, len(files))
    if halves:
        raise ValueError(f"{root}: MXFP4 tensors without their blocks or scales: {sorted(halves)[:4]}")
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        # Some checkpoints drop the head while config says untied; the head is the embedding then.
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    missing = [n for n in model.tensors(cfg) if n not in weights]
    if missing:
        raise ValueError(f"{root}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    return cfg, weights
