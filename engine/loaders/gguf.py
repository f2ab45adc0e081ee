"""GGUF files: metadata to ``ModelConfig``, tensors to float32 in canonical naming.

Generic: ``general.architecture`` picks the definition (``engine.models.for_gguf``),
which parses the ``{arch}.*`` metadata, names each llama.cpp tensor canonically
(splitting fused ones) and undoes any re-layout its converter applied (llama
and mistral's q/k row permutation).

Tensors go through ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1
and every other type the ``gguf`` package knows). GGUF stores a 2-D tensor with
ggml shape ``[in, out]``, which numpy sees as ``[out, in]`` -- already the
``torch.nn.Linear`` layout the backends expect.

As stored (``as_stored``): 2-D tensors of the GGML block types a backend keeps
(its ``weights_as_stored``: the cpu and cuda backends Q8_0 / Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q4_K / Q5_K / Q6_K, the cpu backend Q3_K too) stay in their blocks, as a
:class:`QuantizedTensor` over the raw rows; MXFP4 tensors of any rank (llama.cpp's
gpt-oss experts, ``[experts, out, in]``), where a backend names MXFP4, become
``engine.loaders.mxfp4.Mxfp4Tensor`` (which the definitions index by expert); every
other tensor is float32 as above, except, for a backend that takes 16-bit floats (``bf16_as_stored``), F16 and BF16
matrices, which stay float16 and ``engine.loaders.bf16`` tensors (no float32 copy). Blocks run along the input dimension, so a row of blocks is one output
row and the definitions' row splits and q/k row un-permutation apply to the
raw rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from engine.loaders import bf16, mxfp4
from engine.model_config import ModelConfig
from engine.models import definition, for_gguf

# GGML block types a backend can take as stored (gguf.GGMLQuantizationType values); ``as_stored=True``
# means these (the cpu backend's).
STORED_TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
MXFP4 = 39  # kept as an Mxfp4Tensor, of any rank, not a QuantizedTensor
# Every block type some backend keeps: name -> (type id, values a block, bytes a block).
BLOCK_TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
    "MXFP4": (MXFP4, mxfp4.BLOCK, mxfp4.GGML_BLOCK),
}  # fmt: skip
TYPE_NAMES = {tid: name for name, (tid, _, _) in BLOCK_TYPES.items()}


def stored_type_ids(as_stored: bool | Collection[str]) -> frozenset[int]:
    """The GGML type ids ``as_stored`` names: False none, True ``STORED_TYPES``, else type names."""
    if as_stored is True:
        return frozenset(STORED_TYPES.values())
    if not as_stored:
        return frozenset()
    unknown = set(as_stored) - set(BLOCK_TYPES)
    if unknown:
        raise ValueError(f"no block type {sorted(unknown)} (known: {', '.join(BLOCK_TYPES)})")
    return frozenset(BLOCK_TYPES[n][0] for n in as_stored)


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A matrix ``[out, in]`` kept as GGML stores it: ``data`` uint8 ``[out, row_bytes]``,
    ``type`` the GGML type id (``BLOCK_TYPES``). Only ``load_gguf(as_stored=...)`` makes these."""

    type: int
    shape: tuple[int, int]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type, str(self.type))


def read_metadata(reader) -> dict:
    """Scalar and string fields as Python values; arrays stay out unless small (see ``field_value``)."""
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in ("tokens", "merges", "token_type", "scores"):
            continue  # large; the tokenizer reads these itself
        meta[key] = field_value(f)
    return meta


def field_value(f):
    try:
        return f.contents()
    except Exception:  # older gguf packages lack contents(); fall back to raw parts
        if len(f.data) == 1:
            v = f.parts[f.data[0]]
            return bytes(v).decode("utf-8") if v.dtype == np.uint8 else v[0].item()
        return [f.parts[i][0].item() for i in f.data]


def config_from_metadata(meta: dict, tensor_names: set[str]) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata, by its architecture's definition."""
    return for_gguf(meta["general.architecture"]).config_from_gguf(meta, tensor_names)


def read_config(path: str | Path) -> ModelConfig:
    """The config of a GGUF file from its header, without dequantizing any tensor."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return config_from_metadata(read_metadata(reader), {t.name for t in reader.tensors})


def load_gguf(
    path: str | Path,
    progress: Callable[[int, int], None] | None = None,
    *,
    as_stored: bool | Collection[str] = False,
    bf16_as_stored: bool = False,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF file; return its config and float32 weights in canonical naming.

    ``progress(done, total)`` is called after each tensor. ``as_stored``: matrices of these
    block types (names of ``BLOCK_TYPES``; True: ``STORED_TYPES``) come as
    :class:`QuantizedTensor` instead, MXFP4 ones as ``Mxfp4Tensor`` (see the module
    docstring). ``bf16_as_stored`` (a backend that takes 16-bit floats): F16 matrices come as
    float16 and BF16 ones as ``engine.loaders.bf16`` tensors, not widened (vectors stay float32:
    definitions compute on norms, and only move matrices' rows).
    """
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    meta = read_metadata(reader)
    model = for_gguf(meta["general.architecture"])
    cfg = model.config_from_gguf(meta, names)
    model = definition(cfg.arch)  # a llama GGUF with experts is mixtral's
    weights: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    keep = stored_type_ids(as_stored)
    for done, t in enumerate(reader.tensors, 1):
        if int(t.tensor_type) in keep and int(t.tensor_type) == MXFP4:
            w = mxfp4.from_ggml(t.data, [int(d) for d in reversed(t.shape)])
            weights.update(model.from_gguf(cfg, t.name, w))
        elif int(t.tensor_type) in keep and len(t.shape) == 2:
            raw = np.asarray(t.data, dtype=np.uint8)  # [out, row_bytes], a view of the mapped file
            for name, part in model.from_gguf(cfg, t.name, raw):
                weights[name] = QuantizedTensor(int(t.tensor_type), (part.shape[0], int(t.shape[0])), part)
        elif model.is_known_gguf(t.name):
            w = _half(t) if bf16_as_stored and len(t.shape) == 2 else None
            if w is None:
                w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            # ggml shape is [in, out] (reversed); numpy's view is [out, in].
            w = w.reshape([int(d) for d in reversed(t.shape)])
            for name, part in model.from_gguf(cfg, t.name, w):
                weights[name] = np.ascontiguousarray(part)
        if progress:
            progress(done, total)
    if "rope_freqs.weight" in names:
        # llama3-style GGUFs carry per-pair frequency divisors instead of rope_scaling metadata.
        factors = _vector(reader, "rope_freqs.weight")
        cfg = dataclasses.replace(cfg, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    longrope = {key: _vector(reader, name) for name, key in _LONGROPE_FACTORS.items() if name in names}
    if longrope:
        # phi3's longrope GGUFs: the definition read the metadata half of rope_scaling, the factors are tensors.
        cfg = dataclasses.replace(cfg, rope_scaling={**(cfg.rope_scaling or {}), **longrope})
    if "model.embed_tokens.weight" in weights:
        cfg = dataclasses.replace(cfg, vocab_size=weights["model.embed_tokens.weight"].shape[0])
    return cfg, weights


def _half(t) -> np.ndarray | None:
    """An F16 tensor's data as float16, a BF16 one's as ``engine.loaders.bf16`` (views of the mapped
    file); None for any other type."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.F16:
        return np.asarray(t.data).view(np.float16).reshape(-1)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        return bf16.from_bits(np.asarray(t.data).view(np.uint16).reshape(-1))
    return None


# GGUF tensor -> the rope_scaling key its values fill (longrope's per-pair factors).
_LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def _vector(reader, name: str) -> list[float]:
    """A small 1-D tensor (rope factors) as floats."""
    from gguf.quants import dequantize

    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).tolist()
