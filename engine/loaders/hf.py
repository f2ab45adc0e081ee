"""Hugging Face model directories: config.json plus (sharded) safetensors.

Generic: config.json's ``model_type`` picks the definition
(``engine.models.for_hf``), which parses the config and maps the checkpoint's
tensor names onto the canonical ones (splitting fused tensors into row views).
Weights come back as float32 in canonical naming and ``[out, in]`` layout.

``safetensors.numpy`` cannot produce bfloat16 arrays, so bf16 tensors are read
raw from the file (the header gives each tensor's byte range) and widened with
a uint16 -> float32 shift: bf16 is the top half of an IEEE float32; for a backend
that takes bf16 (``bf16_as_stored``) they stay bf16 bit patterns instead
(``engine.loaders.bf16``), so a load holds no float32 copy of the model. uint8
tensors come through raw: they are quantized data, not values, and so do
F8_E4M3 ones (as their uint8 bit patterns), which the numpy reader cannot
produce. Two quantizations are read:

* MXFP4 (``quantization_config.quant_method == "mxfp4"``, gpt-oss's experts):
  each ``X_blocks`` / ``X_scales`` pair is dequantized to float32 ``X`` before
  the definition maps names (``engine.loaders.mxfp4``), or, for a backend that
  takes MXFP4 as stored (``mxfp4_as_stored``), joined into an ``Mxfp4Tensor``
  whose per-expert rows the definition picks.
* FP8 (``quant_method == "fp8"``, ``fmt`` e4m3, ``weight_block_size`` [B, B] or
  absent): each float8_e4m3fn ``X.weight`` with its ``X.weight_scale_inv``
  (B x B tiles) or ``X.weight_scale`` (per tensor or output channel) becomes an
  ``engine.loaders.fp8.Fp8Tensor`` when the backend takes fp8 as stored
  (``fp8_as_stored``), else float32 (``engine.loaders.fp8``).

Any other quantization method is refused at load. ``weight_format="fp8"``
(``model.weight_format``, for a backend that takes fp8) quantizes a float
checkpoint's projections at load (:func:`engine.loaders.fp8.quantize_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.loaders import bf16, fp8, mxfp4
from engine.model_config import ModelConfig
from engine.models import definition, for_hf

QUANT_METHODS = ("mxfp4", "fp8")  # quantization_config.quant_method values the loader reads
_RAW = ("BF16", "F8_E4M3")  # dtypes read from the file's bytes, not through safetensors' numpy reader


def config_from_hf(config: dict, generation: dict | None = None) -> ModelConfig:
    """``ModelConfig`` from a parsed config.json (and generation_config.json), by its model_type's definition."""
    method = quant_method(config)
    if method is not None and method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (supported: {list(QUANT_METHODS)})"
        )
    if method == "fp8":
        fp8.checkpoint_block(config["quantization_config"])  # refuses e5m2 and non-square tiles up front
    return for_hf(config.get("model_type", "llama")).config_from_hf(config, generation)


def quant_method(config: dict) -> str | None:
    """config.json's ``quantization_config.quant_method`` (None: not quantized)."""
    return (config.get("quantization_config") or {}).get("quant_method")


def read_config(root: Path) -> ModelConfig:
    """The config of a Hugging Face directory, without reading its weights."""
    gen_path = root / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return config_from_hf(json.loads((root / "config.json").read_text()), generation)


def read_safetensors(path: Path, *, keep_bf16: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file as a float32 numpy array (uint8 and F8_E4M3 ones raw, uint8);
    with ``keep_bf16`` the BF16 ones as stored (``engine.loaders.bf16``: no float32 copy). BF16 and
    F8_E4M3 tensors as stored are read-only views of the mapped file."""
    from safetensors import safe_open

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    raw_names = []
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] in _RAW:
            raw_names.append(name)
    if len(raw_names) < len(header) - ("__metadata__" in header):
        with safe_open(str(path), framework="numpy") as st:
            for name in st.keys():
                if name not in raw_names:
                    t = st.get_tensor(name)
                    out[name] = t if t.dtype == np.uint8 else np.asarray(t, dtype=np.float32)
    if raw_names:
        # Views of the mapped file, read-only: no copy of the bytes (the page cache holds them; a
        # tensor kept as stored is first read where it goes, by the uploader).
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for name in raw_names:
            start, end = header[name]["data_offsets"]
            dtype = "<u2" if header[name]["dtype"] == "BF16" else np.uint8  # F8_E4M3: bit patterns
            count = (end - start) // np.dtype(dtype).itemsize
            raw = np.frombuffer(mm, dtype, count, base + start) if count else np.empty(0, dtype)
            if header[name]["dtype"] == "BF16":
                t = bf16.from_bits(raw).reshape(header[name]["shape"])
                out[name] = t if keep_bf16 else bf16.to_float32(t)
            else:
                out[name] = raw.reshape(header[name]["shape"])
    return out


def load_hf(
    path: str | Path,
    progress: Callable[[int, int], None] | None = None,
    *,
    fp8_as_stored: bool = False,
    weight_format: str = "auto",
    bf16_as_stored: bool = False,
    mxfp4_as_stored: bool = False,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face directory; ``progress(done, total)`` counts safetensors files.

    ``bf16_as_stored`` (a backend that takes bf16): a float checkpoint's BF16 tensors stay bf16
    (``engine.loaders.bf16``), unless ``weight_format`` is ``fp8`` (quantizing computes on them)
    or the checkpoint is quantized (its scales are computed on).

    ``fp8_as_stored``: an FP8 checkpoint's matrices come as ``Fp8Tensor`` (unless
    ``weight_format`` is ``bf16``), and ``weight_format`` ``fp8`` quantizes a float
    checkpoint's projections per output channel; without it FP8 is dequantized to float32
    and ``fp8`` is refused (ValueError).

    ``mxfp4_as_stored`` (a backend that takes MXFP4): an MXFP4 checkpoint's experts come as
    ``engine.loaders.mxfp4.Mxfp4Tensor`` ``[out, in]`` (unless ``weight_format`` is ``bf16``).
    """
    root = Path(path)
    cfg = read_config(root)  # first: an unsupported model_type is refused before any weights are read
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {root}")
    check_weight_format(weight_format, fp8_as_stored)
    model = definition(cfg.arch)
    raw_config = json.loads((root / "config.json").read_text())
    method = quant_method(raw_config)
    is_mxfp4 = method == "mxfp4"
    fp8_block = fp8.checkpoint_block(raw_config["quantization_config"]) if method == "fp8" else None
    keep_fp8 = fp8_as_stored and weight_format != "bf16"
    keep_mxfp4 = mxfp4_as_stored and weight_format != "bf16"
    keep_bf16 = bf16_as_stored and method is None and weight_format != "fp8"
    weights: dict[str, np.ndarray] = {}
    halves: dict[str, np.ndarray] = {}  # MXFP4 blocks or scales whose partner is in a later shard
    for done, name in enumerate(files, 1):
        tensors = read_safetensors(root / name, keep_bf16=keep_bf16)
        if is_mxfp4:
            tensors = mxfp4.join_pairs(tensors, halves, keep=keep_mxfp4)
        if method == "fp8":
            tensors = fp8.join_scales(tensors, halves, block=fp8_block, keep=keep_fp8)
            for name in [n for n, t in tensors.items() if isinstance(t, fp8.Fp8Tensor)]:
                t = tensors.pop(name)
                weights.update(fp8.map_rows(t, lambda a, name=name: model.from_hf(cfg, {name: a})))
        weights.update(model.from_hf(cfg, tensors))
        if progress:
            progress(done, len(files))
    if halves:
        raise ValueError(f"{root}: quantized tensors without their data or scales: {sorted(halves)[:4]}")
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        # Some checkpoints drop the head while config says untied; the head is the embedding then.
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    missing = [n for n in model.tensors(cfg) if n not in weights]
    if missing:
        raise ValueError(f"{root}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    if weight_format == "fp8":
        weights = fp8.quantize_weights(weights)
    return cfg, weights


WEIGHT_FORMATS = ("auto", "bf16", "fp8")  # model.weight_format


def check_weight_format(weight_format: str, takes_fp8: bool) -> None:
    """ValueError naming ``model.weight_format`` for a value it does not take, or ``fp8`` where the
    backend cannot take fp8 weights."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"model.weight_format {weight_format!r}: one of {' | '.join(WEIGHT_FORMATS)}")
    if weight_format == "fp8" and not takes_fp8:
        raise ValueError("model.weight_format 'fp8': this backend does not take fp8 weights (use auto or bf16)")
