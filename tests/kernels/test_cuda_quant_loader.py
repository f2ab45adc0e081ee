"""The CPU side of GGUF blocks on the CUDA backend (no GPU needed): which types the loader keeps
for each backend, the row operations on raw rows, and the format bookkeeping of
engine/cu/quant.py and the memory plan."""

from __future__ import annotations

import numpy as np
import pytest

SMOL = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def q4_1_gguf(tmp_path):
    """SmolLM2's Q4_1 GGUF where the models directory holds it (never fetched: the GPU machine has no
    network), else the tiny llama written here as Q4_1 by the gguf package."""
    from tests.conftest import models_dir
    from tests.loaders.tiny_gguf import write_quantized

    path = models_dir() / SMOL
    return path if path.exists() else write_quantized(tmp_path / "tiny-Q4_1.gguf", "Q4_1")


def test_as_stored_type_sets(q4_1_gguf):
    """The cuda backend's types keep the Q4_1 matrices (and SmolLM2's Q8_0 embedding) as blocks; True
    means the cpu backend's types; unknown names are refused."""
    from engine.backends.cpu import CpuBackend
    from engine.backends.cuda import CudaBackend
    from engine.loaders.gguf import STORED_TYPES, load_gguf, stored_type_ids

    assert CudaBackend.weights_as_stored >= {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    assert stored_type_ids(True) == stored_type_ids(CpuBackend.weights_as_stored) == set(STORED_TYPES.values())
    assert stored_type_ids(False) == frozenset()
    with pytest.raises(ValueError, match="no block type"):
        stored_type_ids({"Q4_9"})
    _, w = load_gguf(q4_1_gguf, as_stored=CudaBackend.weights_as_stored)
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert q.type_name == "Q4_1" and q.data.shape == (q.shape[0], q.shape[1] // 32 * 20)
    smol = q4_1_gguf.name.startswith("SmolLM2")
    assert w["model.embed_tokens.weight"].type_name == ("Q8_0" if smol else "Q4_1")


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q5_0"])
def test_row_operations_on_raw_rows(fmt):
    """The definition's q/k un-permutation on rows of blocks, then gguf's dequantize, equals the
    un-permutation of the dequantized values (what the loader relies on for every kept type)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from engine.model_config import ModelConfig
    from engine.models import definition
    from tests.kernels.test_cuda_quant import random_blocks

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=512, intermediate_size=512, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=64)  # fmt: skip
    llama, t = definition("llama"), GGMLQuantizationType[fmt]
    raw = random_blocks(fmt, 512, 512)
    ((name, moved),) = llama.from_gguf(cfg, "blk.0.attn_q.weight", raw)
    ((_, want),) = llama.from_gguf(cfg, "blk.0.attn_q.weight", np.asarray(dequantize(raw, t), np.float32))
    assert name == "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(np.asarray(dequantize(np.ascontiguousarray(moved), t), np.float32), want)
    assert not np.array_equal(moved, raw)  # rows did move


def test_matrix_bookkeeping():
    from engine.cu.quant import Matrix, Part, row_bytes
    from engine.memory import dequant_scratch_bytes
    from tests.kernels.hf_models import LLAMA8B

    assert row_bytes("Q4_K", 4096) == 16 * 144 and row_bytes("Q8_0", 576) == 18 * 34 and row_bytes("bf16", 8) == 16
    with pytest.raises(ValueError):
        row_bytes("Q6_K", 576)  # K-quant rows are whole 256-value super-blocks
    m = Matrix((Part(0, "Q4_K", 5120), Part(1 << 20, "Q6_K", 1024)), 4096)
    assert m.rows == 6144 and m.formats == ("Q4_K", "Q6_K") and m.nbytes == 5120 * 2304 + 1024 * 3360
    from engine.model_config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=LLAMA8B["vocab_size"], hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
    assert dequant_scratch_bytes(cfg) == 2 * 28672 * 4096  # gate,up is the 8B shape's largest layer matrix
