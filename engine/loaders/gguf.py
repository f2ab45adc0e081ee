"""GGUF files: metadata to ``ModelConfig``, tensors to float32 in Hugging Face naming.

Tensors go through ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1
and every other type the ``gguf`` package knows). GGUF stores a 2-D tensor with
ggml shape ``[in, out]``, which numpy sees as ``[out, in]`` -- already the
``torch.nn.Linear`` layout the backends expect.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of llama-arch
models so that its rotary kernel can rotate adjacent pairs (GPT-J style); HF's
``rotate_half`` pairs element ``i`` with ``i + head_dim/2``. We undo that
permutation here so every backend sees the HF layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.model_config import ModelConfig

# Architectures whose q/k rows llama.cpp's convert script permutes.
_PERMUTED_ARCHS = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head)`` on the output rows of q/k (weights or biases)."""
    head_dim = w.shape[0] // n_head
    rest = w.shape[1:]
    return np.ascontiguousarray(w.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape))


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
    """Build a ``ModelConfig`` from ``{arch}.*`` metadata keys (llama, mistral, qwen2)."""
    arch = meta["general.architecture"]

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", 0) or hidden // num_heads)
    vocab = key("vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", [])) or None
    rope_scaling = None
    if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab) if vocab is not None else 0,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position=int(key("context_length", 8192)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def load_gguf(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF file; return its config and float32 weights named the HF way.

    ``progress(done, total)`` is called after each tensor.
    """
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    cfg = config_from_metadata(read_metadata(reader), names)
    weights: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for done, t in enumerate(reader.tensors, 1):
        name = hf_name(t.name)
        if name is not None:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            # ggml shape is [in, out] (reversed); numpy's view is [out, in].
            w = w.reshape([int(d) for d in reversed(t.shape)])
            if cfg.arch in _PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
                w = unpermute_rows(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
            weights[name] = np.ascontiguousarray(w)
        if progress:
            progress(done, total)
    if "rope_freqs.weight" in names:
        # llama3-style GGUFs carry per-pair frequency divisors instead of rope_scaling metadata.
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
        cfg = _replace(cfg, rope_scaling={"rope_type": "freq_factors", "factors": factors.tolist()})
    if "model.embed_tokens.weight" in weights:
        cfg = _replace(cfg, vocab_size=weights["model.embed_tokens.weight"].shape[0])
    return cfg, weights


def _replace(cfg: ModelConfig, **changes) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)
