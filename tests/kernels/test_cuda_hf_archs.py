"""Every architecture's real definition on the CUDA backend against transformers and the numpy backend.

A small random checkpoint per architecture (transformers' own classes, ``save_pretrained``, shapes the
kernels take: hidden 256, head_dim 64), loaded through the engine's loader: last-position logits within
cosine 0.999 of transformers (float32, CPU) on prompts longer than the sliding windows, and greedy
continuations equal to the numpy backend's until the first near-tie. Skipped without a device.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]

DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=2048, initializer_range=0.02, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip


def build(arch: str, path):
    """Write ``arch``'s checkpoint to ``path``; return transformers' float32 model of it."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    theta = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    if arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(num_hidden_layers=3, tie_word_embeddings=False, **theta, **DIMS))
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                mlp_only_layers=[], **theta, **DIMS)  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(
            num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, **{**DIMS, "intermediate_size": 256}
        )
        model = tf.MixtralForCausalLM(cfg)
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=2, sliding_window=8, **DIMS))
    elif arch == "phi3":
        d = {k: v for k, v in DIMS.items() if k != "head_dim"}
        model = tf.Phi3ForCausalLM(
            tf.Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.75, sliding_window=None, **d)
        )
    elif arch in ("gemma2", "gemma3"):
        from tests.models.tiny_gemma import tiny_gemma

        model = tiny_gemma(arch, **{**DIMS, "query_pre_attn_scalar": 64})
    elif arch == "gpt_oss":
        from tests.models.tiny_gpt_oss import write_checkpoint

        write_checkpoint(path, **{**DIMS, "intermediate_size": 128, "swiglu_limit": 7.0})
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # norms off their initial constant, so a wrong one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0 if arch in ("gemma2", "gemma3") else 1.0, 0.1)
            p.copy_(p.to(torch.bfloat16).float())  # the weights a bf16 checkpoint holds, on both sides
    model.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "mistral", "phi3", "gemma2", "gemma3", "gpt_oss"])
def test_the_cuda_backend_matches_transformers_and_numpy(arch, tmp_path):
    import torch

    from engine.backends import create_backend
    from engine.loaders import load_artifact
    from tests.kernels.test_cuda_archs import assert_follows
    from tests.kernels.test_cuda_model import _run_lanes, cosine, prefill_logits

    model = build(arch, tmp_path)
    cfg, weights = load_artifact(tmp_path)
    assert cfg.arch == arch
    be = create_backend("cuda")
    be.load(cfg, weights, block_size=16, kv_budget_bytes=256 << 20, host_kv_budget_bytes=0, max_context=1024)
    ref = create_backend("numpy")
    ref.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
    try:
        rng = np.random.default_rng(1)
        for n in (5, 23, 61):
            ids = rng.integers(0, cfg.vocab_size, n).tolist()
            with torch.no_grad():
                want = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            got = prefill_logits(be, ids, list(range(-(-n // 16))))
            assert cosine(got, want) >= 0.999, (arch, n, cosine(got, want))
        prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(8, 40))).tolist() for _ in range(4)]
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
        (cuda_toks, _), (np_toks, _) = _run_lanes(be, prompts, tables, 12, 4), _run_lanes(ref, prompts, tables, 12, 4)
        assert_follows(ref, prompts, np_toks, cuda_toks, f"{arch}: ")
    finally:
        be.unload()
        ref.unload()
