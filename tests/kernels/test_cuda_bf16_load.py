"""A bf16 checkpoint loaded for the card with its tensors kept as stored (engine/loaders/bf16.py)
runs bit for bit as the same checkpoint widened to float32 first: the same bits go up."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma2"])
def test_kept_bf16_runs_as_widened(arch, tmp_path):
    import torch

    from engine.backends import create_backend
    from engine.loaders import bf16, load_artifact
    from tests.kernels.test_cuda_hf_archs import build
    from tests.kernels.test_cuda_model import prefill_logits

    model = build(arch, tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    cfg, widened = load_artifact(tmp_path / "bf16")
    _, kept = load_artifact(tmp_path / "bf16", bf16_as_stored=True)
    assert any(bf16.is_bf16(w) for w in kept.values())
    logits = []
    for weights in (widened, kept):
        be = create_backend("cuda")
        be.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
        try:
            ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 37).tolist()
            logits.append(prefill_logits(be, ids, list(range(3))))
        finally:
            be.unload()
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_half_gguf_kept_runs_as_widened(qtype, tmp_path):
    from engine.backends import create_backend
    from engine.loaders import load_artifact
    from tests.kernels.test_cuda_model import prefill_logits
    from tests.loaders.tiny_gguf import write_quantized

    path = write_quantized(tmp_path / f"tiny-{qtype}.gguf", qtype)
    logits = []
    for keep in (False, True):
        cfg, weights = load_artifact(path, bf16_as_stored=keep)
        be = create_backend("cuda")
        be.load(cfg, weights, block_size=16, kv_budget_bytes=64 << 20, host_kv_budget_bytes=0, max_context=1024)
        try:
            ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 29).tolist()
            logits.append(prefill_logits(be, ids, list(range(2))))
        finally:
            be.unload()
    np.testing.assert_array_equal(logits[0], logits[1])
