"""Model artifacts in, ``(ModelConfig, float32 weights in HF naming)`` out.

Two formats: a ``.gguf`` file, or a Hugging Face directory (config.json and
safetensors). Both loaders are generic: the model's definition
(``engine.models``) parses its config and names its tensors, so backends never
see the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from engine.model_config import ModelConfig


def artifact_format(path: str | Path) -> str:
    """``"gguf"`` for a .gguf file, ``"hf"`` for a directory with config.json."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").exists():
        return "hf"
    raise ValueError(f"not a model artifact (a .gguf file or a directory with config.json): {p}")


def read_config(path: str | Path) -> ModelConfig:
    """The model's config without reading its weights (GGUF metadata, or config.json)."""
    if artifact_format(path) == "gguf":
        from engine.loaders.gguf import read_config as read_gguf_config

        return read_gguf_config(path)
    from engine.loaders.hf import read_config as read_hf_config

    return read_hf_config(Path(path))


def load_artifact(
    path: str | Path,
    progress: Callable[[int, int], None] | None = None,
    *,
    as_stored: bool | Collection[str] = False,
    fp8_as_stored: bool = False,
    weight_format: str = "auto",
    bf16_as_stored: bool = False,
    mxfp4_as_stored: bool = False,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Load any supported artifact; ``progress(done, total)`` reports load progress.

    ``as_stored``: a GGUF's matrices of these block types (GGML type names; True: the cpu
    backend's, ``engine.loaders.gguf.STORED_TYPES``) stay quantized
    (``engine.loaders.gguf.QuantizedTensor``). ``fp8_as_stored`` (a backend that takes
    fp8): an FP8 checkpoint's matrices stay ``engine.loaders.fp8.Fp8Tensor``, else they
    are float32. ``weight_format`` is ``model.weight_format``: ``fp8`` (only with
    ``fp8_as_stored``) quantizes float projections to e4m3 per output channel at load,
    ``bf16`` dequantizes FP8 checkpoints, ``auto`` keeps what is stored. ``bf16_as_stored``
    (a backend that takes bf16): a Hugging Face checkpoint's bf16 tensors stay bf16
    (``engine.loaders.bf16``), a GGUF's F16 / BF16 matrices float16 / bf16. ``mxfp4_as_stored``
    (a backend that takes MXFP4): a Hugging Face MXFP4 checkpoint's experts stay
    ``engine.loaders.mxfp4.Mxfp4Tensor`` unless ``weight_format`` is ``bf16`` (a GGUF's MXFP4
    tensors: ``"MXFP4"`` in ``as_stored``).
    """
    from engine.loaders.hf import check_weight_format

    check_weight_format(weight_format, fp8_as_stored)
    if artifact_format(path) == "gguf":
        from engine.loaders.gguf import load_gguf

        keep16 = bf16_as_stored and weight_format != "fp8"  # quantizing to fp8 computes on the floats
        cfg, weights = load_gguf(path, progress, as_stored=as_stored, bf16_as_stored=keep16)
        if weight_format == "fp8":
            from engine.loaders.fp8 import quantize_weights

            weights = quantize_weights(weights)
        return cfg, weights
    from engine.loaders.hf import load_hf

    return load_hf(path, progress, fp8_as_stored=fp8_as_stored, weight_format=weight_format,
                   bf16_as_stored=bf16_as_stored, mxfp4_as_stored=mxfp4_as_stored)  # fmt: skip
