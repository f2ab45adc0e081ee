"""The shape of a decoder-only transformer, independent of where it came from.

Both loaders (GGUF and Hugging Face directories) produce a ``ModelConfig`` and a
dict of float32 weights named the Hugging Face llama way
(``model.layers.{i}.self_attn.q_proj.weight`` ...), laid out ``[out, in]`` as
``torch.nn.Linear`` stores them. Backends consume nothing else; which tensors a
model has is its definition's ``tensors(cfg)`` (``engine.models``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # a model definition's name (engine.models.DEFINITIONS): "llama", "qwen2", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict (llama3: factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings), or None.
    rope_scaling: dict | None = None
    max_position: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v projections carry biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """K and V for one token across all layers, in float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
