"""qwen2 (SKELETON: the models helper fills in config parsing and names)."""

from engine.models.base import ModelDefinition

QWEN2 = ModelDefinition("qwen2", ("qwen2",), ("qwen2",))
