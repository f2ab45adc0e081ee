"""Random-weight Hugging Face models on the GPU, shared by the GPU tests and
bench/bench_cuda.py (works with transformers 4.x ``rope_theta``/``rope_scaling``
and 5.x ``rope_parameters``)."""

from __future__ import annotations

LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               tie_word_embeddings=False)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
QWEN_SMALL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=True, initializer_range=0.05)  # fmt: skip
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def hf_config(arch: str, rope: dict, **kw):
    import transformers

    cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    if int(transformers.__version__.split(".")[0]) >= 5:
        hf = cls(rope_parameters=dict(rope), **kw)
    else:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        hf = cls(rope_theta=rope["rope_theta"], rope_scaling=None if rope["rope_type"] == "default" else scaling, **kw)
    hf._attn_implementation = "eager"
    return hf


def rope_of(hf) -> tuple[float, dict | None]:
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    scaling = getattr(hf, "rope_scaling", None)
    if not scaling and rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    return theta, scaling or None


def model_config(hf, arch: str):
    from engine.model_config import ModelConfig

    theta, scaling = rope_of(hf)
    return ModelConfig(
        arch=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads, rms_norm_eps=hf.rms_norm_eps, rope_theta=theta,
        rope_scaling=scaling, max_position=hf.max_position_embeddings, tie_word_embeddings=hf.tie_word_embeddings,
        attention_bias=(arch == "qwen2"),
    )  # fmt: skip


def random_model(arch: str, rope: dict, dtype: str = "float32", bf16_exact: bool = True, **kw):
    """A random-weight model built on the GPU; with ``bf16_exact`` its weights are bf16-representable."""
    import torch
    import transformers

    hf = hf_config(arch, rope, **kw)
    cls = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("cuda"):
            model = cls(hf).eval()
    finally:
        torch.set_default_dtype(prev)
    if bf16_exact and dt != torch.bfloat16:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(dt))
    return model, model_config(hf, arch)
