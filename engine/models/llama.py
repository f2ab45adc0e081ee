"""llama and mistral (SKELETON: the models helper fills in config parsing and names)."""

from engine.models.base import ModelDefinition

LLAMA = ModelDefinition("llama", ("llama",), ("llama",))
MISTRAL = ModelDefinition("mistral", ("mistral",), ("mistral",))
