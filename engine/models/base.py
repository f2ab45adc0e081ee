"""What every model definition provides: the contract backends and loaders rely on.

A definition says what a model *is*, independent of any backend:

* its config: ``config_from_hf`` (config.json plus generation_config.json) and
  ``config_from_gguf`` (``{arch}.*`` metadata) both produce a ``ModelConfig``;
* its tensors: ``tensors(cfg)`` lists every canonical tensor (Hugging Face llama
  naming, float32 ``[out, in]``) with its shape; ``from_hf`` / ``from_gguf`` map
  a checkpoint's own names onto those, applying any re-layout the format needs
  (split fused tensors, undo llama.cpp's q/k row permutation);
* its computation: ``embedding(cfg)``, ``block(cfg, layer)`` for each layer
  and ``head(cfg)`` as operations from ``engine.models.ops``, which each
  backend implements.

The checkpoint mapping is declared as data (:class:`TensorMap`); this module
applies it, so a family file only lists names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.model_config import ModelConfig
from engine.models.ops import Block, Embedding, Head

LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class TensorMap:
    """How one checkpoint format names the canonical tensors.

    ``layer`` maps a per-layer suffix (after ``model.layers.{i}.`` or ``blk.{i}.``)
    and ``globals`` a whole name to the canonical name(s) it holds. A tuple of
    several canonical names is a fused tensor: the parts stacked by rows in that
    order, each as many rows as ``tensors(cfg)`` gives it. Names absent from both
    tables pass through when ``passthrough`` (HF names already canonical) and are
    dropped otherwise.
    """

    layer: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    globals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    layer_prefix: str = LAYER_PREFIX
    passthrough: bool = False


@dataclass(frozen=True)
class ModelDefinition:
    """One architecture. Subclasses fill in the config parsing, tensors and block."""

    name: str  # ModelConfig.arch
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    hf_map: TensorMap = field(default=TensorMap(passthrough=True), repr=False)  # safetensors names
    gguf_map: TensorMap = field(default=TensorMap(), repr=False)  # llama.cpp names

    # --- config ------------------------------------------------------------------------

    def config_from_hf(self, config: dict, generation: dict | None = None) -> ModelConfig:
        """``ModelConfig`` from a parsed config.json (and generation_config.json if present)."""
        raise NotImplementedError

    def config_from_gguf(self, meta: dict, tensor_names: set[str]) -> ModelConfig:
        """``ModelConfig`` from GGUF metadata (``general.*``, ``{arch}.*``, ``tokenizer.ggml.*`` ids)."""
        raise NotImplementedError

    # --- what the model computes -------------------------------------------------------

    def embedding(self, cfg: ModelConfig) -> Embedding:
        """How token ids become the first residual rows (default: the embedding rows, unscaled)."""
        return Embedding()

    def block(self, cfg: ModelConfig, layer: int) -> Block:
        """Decoder layer ``layer`` (0-based), as operations."""
        raise NotImplementedError

    def blocks(self, cfg: ModelConfig) -> list[Block]:
        """Every decoder layer's block, in order."""
        return [self.block(cfg, i) for i in range(cfg.num_layers)]

    def head(self, cfg: ModelConfig) -> Head:
        """What runs after the last layer."""
        raise NotImplementedError

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Canonical (HF llama) name -> shape ``[out, in]`` of every tensor a backend receives."""
        raise NotImplementedError

    # --- checkpoint names --------------------------------------------------------------

    def relayout_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> np.ndarray:
        """A canonical tensor as the GGUF converter stored it -> HF layout (default: unchanged)."""
        return w

    def from_hf(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Safetensors names -> canonical names (fused tensors split into row views, no copy)."""
        out: dict[str, np.ndarray] = {}
        for name, w in weights.items():
            out.update(split_fused(cfg, self, self.hf_map, name, w))
        return out

    def from_gguf(self, cfg: ModelConfig, name: str, w: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """One GGUF tensor (numpy layout ``[out, in]``) -> its canonical tensor(s) in HF layout."""
        for canonical, part in split_fused(cfg, self, self.gguf_map, name, w):
            yield canonical, self.relayout_gguf(cfg, canonical, part)

    def is_known_gguf(self, name: str) -> bool:
        """Whether ``name`` is one of the GGUF tensors this definition uses."""
        return _lookup(self.gguf_map, name) is not None


def split_fused(
    cfg: ModelConfig, d: ModelDefinition, table: TensorMap, name: str, w: np.ndarray
) -> Iterator[tuple[str, np.ndarray]]:
    """``(canonical name, array)`` for each part of checkpoint tensor ``name`` (none if unused)."""
    canonical = _lookup(table, name)
    if canonical is None:
        return
    if len(canonical) == 1:
        yield canonical[0], w
        return
    shapes = d.tensors(cfg)
    rows = [shapes[c][0] for c in canonical]
    if sum(rows) != w.shape[0]:
        raise ValueError(f"{name}: {w.shape[0]} rows, expected {' + '.join(map(str, rows))} ({', '.join(canonical)})")
    start = 0
    for c, n in zip(canonical, rows):
        yield c, w[start : start + n]
        start += n


def _lookup(table: TensorMap, name: str) -> tuple[str, ...] | None:
    if name in table.globals:
        return table.globals[name]
    if name.startswith(table.layer_prefix):
        layer, _, suffix = name[len(table.layer_prefix) :].partition(".")
        if layer.isdigit() and suffix in table.layer:
            return tuple(f"{LAYER_PREFIX}{layer}.{c}" for c in table.layer[suffix])
    return (name,) if table.passthrough else None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head)`` on the output rows of q/k (weights or biases).

    llama.cpp's converter reorders each head's rows so its rotary kernel can
    rotate adjacent pairs (GPT-J style); HF's ``rotate_half`` pairs element ``i``
    with ``i + head_dim/2``.
    """
    head_dim = w.shape[0] // n_head
    rest = w.shape[1:]
    return np.ascontiguousarray(w.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape))


def eos_ids(value) -> tuple[int, ...]:
    """An ``eos_token_id`` field (an int, a list of them, or None) as a tuple."""
    if value is None:
        return ()
    return tuple(int(e) for e in value) if isinstance(value, list) else (int(value),)
