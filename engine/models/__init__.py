"""Model definitions: one module per architecture family, found by name.

``definition(cfg.arch)`` is how a backend or the memory plan learns what a
loaded model is: its block as operations (``engine.models.ops``), its tensors
and their shapes. Loaders find the definition for a checkpoint with
``for_hf(model_type)`` / ``for_gguf(general.architecture)``.
"""

from __future__ import annotations

from engine.models.base import ModelDefinition
from engine.models.gemma import GEMMA2, GEMMA3
from engine.models.gpt_oss import GPT_OSS
from engine.models.llama import LLAMA, MISTRAL
from engine.models.mixtral import MIXTRAL
from engine.models.phi3 import PHI3
from engine.models.qwen2 import QWEN2
from engine.models.qwen2_5_vl import QWEN2_5_VL
from engine.models.qwen3 import QWEN3, QWEN3_MOE

DEFINITIONS: dict[str, ModelDefinition] = {d.name: d for d in (LLAMA, MISTRAL, QWEN2, PHI3, GEMMA2, GEMMA3, GPT_OSS)}
DEFINITIONS.update({d.name: d for d in (QWEN3, QWEN3_MOE)})
DEFINITIONS.update({d.name: d for d in (MIXTRAL, QWEN2_5_VL)})


def definition(arch: str) -> ModelDefinition:
    """The definition of a loaded model (``ModelConfig.arch``)."""
    try:
        return DEFINITIONS[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {sorted(DEFINITIONS)})") from None


def for_hf(model_type: str) -> ModelDefinition:
    """The definition for a config.json's ``model_type``; ValueError naming the supported ones."""
    return _find(model_type, "hf_model_types", "model_type")


def for_gguf(arch: str) -> ModelDefinition:
    """The definition for a GGUF's ``general.architecture``; ValueError naming the supported ones."""
    return _find(arch, "gguf_archs", "GGUF architecture")


def _find(name: str, field: str, what: str) -> ModelDefinition:
    for d in DEFINITIONS.values():
        if name in getattr(d, field):
            return d
    supported = sorted(n for d in DEFINITIONS.values() for n in getattr(d, field))
    raise ValueError(f"unsupported {what} {name!r} (supported: {supported})")
