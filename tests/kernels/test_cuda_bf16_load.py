"""A bf16 checkpoint loaded for the card with its tensors kept as stored (engine/loaders/bf16.py)
runs bit for bit as the same checkpoint widened to float32 first: the same bits go up."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]


def prefill_each(cfg, weight_sets, n: int, seed: int) -> list[np.ndarray]:
    """The last-position logits of one random ``n``-token prompt, on a fresh CUDA load of each set."""
    from engine.backends import create_backend
    from tests.kernels.test_cuda_model import prefill_logits

    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, n).tolist()
    logits = []
    for weights in weight_sets:
        be = create_backend("cuda")
        be.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
        try:
            logits.append(prefill_logits(be, ids, list(range(-(-n // 16)))))
        finally:
            be.unload()
    return logits


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma2"])
def test_kept_bf16_runs_as_widened(arch, tmp_path):
    import torch

    from engine.loaders import bf16, load_artifact
    from tests.kernels.test_cuda_hf_archs import build

    model = build(arch, tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    cfg, widened = load_artifact(tmp_path / "bf16")
    _, kept = load_artifact(tmp_path / "bf16", bf16_as_stored=True)
    assert any(bf16.is_bf16(w) for w in kept.values())
    a, b = prefill_each(cfg, (widened, kept), 37, seed=3)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_half_gguf_kept_runs_as_widened(qtype, tmp_path):
    from engine.loaders import load_artifact
    from tests.loaders.tiny_gguf import write_quantized

    path = write_quantized(tmp_path / f"tiny-{qtype}.gguf", qtype)
    cfg, widened = load_artifact(path)
    _, kept = load_artifact(path, bf16_as_stored=True)
    a, b = prefill_each(cfg, (widened, kept), 29, seed=5)
    np.testing.assert_array_equal(a, b)
