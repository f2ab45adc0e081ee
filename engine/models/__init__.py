"""Model definitions: one module per architecture family, found by name.

``definition(cfg.arch)`` is how a backend or the memory plan learns what a
loaded model is: its block as operations (``engine.models.ops``), its tensors
and their shapes. Loaders find the definition for a checkpoint with
``for_hf(model_type)`` / ``for_gguf(general.architecture)``.
"""

from __future__ import annotations

from engine.models.base import ModelDefinition
from engine.models.llama import LLAMA, MISTRAL
from engine.models.phi3 import PHI3
from engine.models.qwen2 import QWEN2

DEFINITIONS: dict[str, ModelDefinition] = {d.name: d for d in (LLAMA, MISTRAL, QWEN2, PHI3)}


def definition(arch: str) -> ModelDefinition:
    """The definition of a loaded model (``ModelConfig.arch``)."""
    try:
        return DEFINITIONS[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {sorted(DEFINITIONS)})") from None


def for_hf(model_type: str) -> ModelDefinition:
    """The definition for a config.json's ``model_type``; ValueError naming the supported ones."""
    for d in DEFINITIONS.values():
        if model_type in d.hf_model_types:
            return d
    supported = sorted(t for d in DEFINITIONS.values() for t in d.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")


def for_gguf(arch: str) -> ModelDefinition:
    """The definition for a GGUF's ``general.architecture``; ValueError naming the supported ones."""
    for d in DEFINITIONS.values():
        if arch in d.gguf_archs:
            return d
    supported = sorted(a for d in DEFINITIONS.values() for a in d.gguf_archs)
    raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {supported})")
