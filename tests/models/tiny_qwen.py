"""Tiny random qwen3 / qwen3_moe / mixtral checkpoints, and their GGUF twins.

``write_tiny_qwen3`` / ``write_tiny_qwen3_moe`` write a servable Hugging Face
directory (config, safetensors, the default GGUF's tokenizer and chat template,
as ``tests/models/tiny.py`` does for llama). ``write_gguf_twin`` writes a
directory's weights as llama.cpp's converter would: its architecture name and
metadata keys, its tensor names, experts stacked into ``ffn_*_exps``, q/k rows
permuted where it permutes them (mixtral, converted as "llama"), F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def randomize_norms(model, std: float = 0.2) -> None:
    """Norm weights around 1 instead of exactly 1, so a swapped or missing norm shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, std)


def _save_servable(model, target: Path, bundle) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    bundle.tokenizer.save(str(target / "tokenizer.json"))
    meta = {"chat_template": bundle.chat_template, "bos_token": bundle.bos_token, "eos_token": bundle.eos_token}
    (target / "tokenizer_config.json").write_text(json.dumps(meta))
    (target / "generation_config.json").unlink(missing_ok=True)
    return target


def write_tiny_qwen3(target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """A 2-layer qwen3 (explicit head_dim 32, q/k norms, tied embeddings) with the default GGUF's vocabulary."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=bundle.tokenizer.get_vocab_size(), intermediate_size=128, num_hidden_layers=2, head_dim=32,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **SMALL,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    randomize_norms(model)
    return _save_servable(model, target, bundle)


def write_tiny_qwen3_moe(target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """A 2-layer qwen3_moe (8 experts, top 2; layer 1 dense) with the default GGUF's vocabulary."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=bundle.tokenizer.get_vocab_size(), intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=2,
        head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        **SMALL,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    randomize_norms(model)
    return _save_servable(model, target, bundle)


# --- llama.cpp's layout -------------------------------------------------------------------

_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}  # fmt: skip
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}  # fmt: skip
_EXPERT = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (each head's halves interleaved in pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_twin(hf_dir: Path, path: Path, *, stacked: bool = True) -> Path:
    """``hf_dir``'s checkpoint as a llama.cpp GGUF; ``stacked`` False writes one tensor per expert
    (``blk.N.ffn_gate.{e}.weight``), the layout of mixtral GGUFs before ``_exps``."""
    import gguf

    from engine.loaders.hf import read_safetensors

    hf = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCH[hf["model_type"]]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if hf.get("head_dim"):
        writer.add_key_length(hf["head_dim"])
        writer.add_value_length(hf["head_dim"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "llama" and hf.get("sliding_window"):  # as for mistral, converted to "llama" too
        writer.add_sliding_window(hf["sliding_window"])
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(hf["num_experts_per_tok"])
    if hf.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if hf.get(key) is not None:
            add(hf[key])

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in read_safetensors(hf_dir / "model.safetensors").items():
        if name in _GLOBALS:
            writer.add_tensor(_GLOBALS[name], t)
            continue
        _, _, layer, suffix = name.split(".", 3)
        if ".experts." in suffix:
            _, e, proj, _ = suffix.rsplit(".", 3)
            experts.setdefault((layer, _EXPERT[proj]), {})[int(e)] = t
            continue
        if arch == "llama" and suffix.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
            t = llama_cpp_permute(t, heads if ".q_proj." in suffix else kv_heads)
        writer.add_tensor(f"blk.{layer}.{_LAYER[suffix]}", np.ascontiguousarray(t))
    for (layer, kind), per_expert in experts.items():
        if stacked:
            writer.add_tensor(
                f"blk.{layer}.ffn_{kind}_exps.weight", np.stack([per_expert[e] for e in sorted(per_expert)])
            )
        else:
            for e, t in per_expert.items():
                writer.add_tensor(f"blk.{layer}.ffn_{kind}.{e}.weight", t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
