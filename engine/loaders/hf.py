"""Hugging Face model directories: config.json plus (sharded) safetensors.

Generic: config.json's ``model_type`` picks the definition
(``engine.models.for_hf``), which parses the config and maps the checkpoint's
tensor names onto the canonical ones (splitting fused tensors into row views).
Weights come back as float32 in canonical naming and ``[out, in]`` layout.

``safetensors.numpy`` cannot produce bfloat16 arrays, so bf16 tensors are read
raw from the file (the header gives each tensor's byte range) and widened with
a uint16 -> float32 shift: bf16 is the top half of an IEEE float32.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.model_config import ModelConfig
from engine.models import definition, for_hf


def config_from_hf(config: dict, generation: dict | None = None) -> ModelConfig:
    """``ModelConfig`` from a parsed config.json (and generation_config.json), by its model_type's definition."""
    return for_hf(config.get("model_type", "llama")).config_from_hf(config, generation)


def read_config(root: Path) -> ModelConfig:
    """The config of a Hugging Face directory, without reading its weights."""
    gen_path = root / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return config_from_hf(json.loads((root / "config.json").read_text()), generation)


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
    cfg = read_config(root)  # first: an unsupported model_type is refused before any weights are read
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {root}")
    model = definition(cfg.arch)
    weights: dict[str, np.ndarray] = {}
    for done, name in enumerate(files, 1):
        weights.update(model.from_hf(cfg, read_safetensors(root / name)))
        if progress:
            progress(done, len(files))
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        # Some checkpoints drop the head while config says untied; the head is the embedding then.
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    missing = [n for n in model.tensors(cfg) if n not in weights]
    if missing:
        raise ValueError(f"{root}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    return cfg, weights
