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
class VisionConfig:
    """A vision tower in front of the language model (qwen2_5_vl: ``engine.models.vision``).

    Images arrive as patches (``patch_dim`` = ``in_channels * temporal_patch_size * patch_size**2``
    values each, the processor's order); every ``spatial_merge_size**2`` patches become one
    placeholder token of ``image_token_id`` in the prompt, whose embedding the tower's output replaces.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # = the language model's hidden size
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112  # pixels a side of an attention window (blocks not in fullatt_block_indexes)
    fullatt_block_indexes: tuple[int, ...] = ()
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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
    # Sliding-window attention: the window of the layers that slide, and which do
    # ("sliding_attention" / "full_attention" per layer, HF's ``layer_types``);
    # an empty ``layer_types`` with a window set means every layer slides (mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Sparse MoE layers (qwen3_moe, mixtral, gpt_oss): experts, experts per token, expert width.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Settings only the architecture's own definition reads (gemma's softcaps and
    # query_pre_attn_scalar, qwen3_moe's mlp_only_layers, gpt-oss's swiglu_limit, ...).
    params: dict = field(default_factory=dict, compare=False, hash=False)
    # A vision-language model's tower (None: text only); its images' rows replace placeholder tokens.
    vision: VisionConfig | None = None

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def all_layers_slide(self) -> bool:
        """Every layer windowed: KV pages wholly behind the window can be released."""
        return all(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """K and V for one token across all layers, in float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
