"""bf16 checkpoint tensors kept as stored for a backend that takes bf16 (engine/loaders/bf16.py):
the same values as the float32 path, the same bits on their way to the card, no arithmetic on bits,
and the flag reaching the loader only for such a backend."""

from __future__ import annotations

import numpy as np
import pytest

from engine.loaders import bf16, load_artifact

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny qwen2 (biases, untied head) and a tiny gemma2 (1 + w norms) saved in bf16."""
    torch.manual_seed(0)
    out = {}
    dims = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    for name, model in (
        ("qwen2", transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **dims))),
        ("gemma2", transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=16, **dims))),
    ):
        path = tmp_path_factory.mktemp(name)
        model.to(torch.bfloat16).save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_kept_tensors_hold_the_float32_paths_values(checkpoint, arch):
    cfg, as_float = load_artifact(checkpoint[arch])
    cfg2, kept = load_artifact(checkpoint[arch], bf16_as_stored=True)
    assert cfg2 == cfg and kept.keys() == as_float.keys()
    assert all(bf16.is_bf16(w) for w in kept.values())  # every tensor of a bf16 checkpoint
    for name, w in kept.items():
        assert w.shape == as_float[name].shape
        np.testing.assert_array_equal(bf16.to_float32(w), as_float[name])


def test_the_cards_bits_are_the_float32_paths_rounded(checkpoint):
    from engine.backends.cuda.weights import dequantized, interleave_gate_up, interleave_rope, to_bf16

    _, as_float = load_artifact(checkpoint["qwen2"])
    _, kept = load_artifact(checkpoint["qwen2"], bf16_as_stored=True)
    for name in as_float:
        np.testing.assert_array_equal(to_bf16(kept[name]), to_bf16(as_float[name]))
        np.testing.assert_array_equal(dequantized(kept[name]), as_float[name])
    # The uploader's row permutations move bits as they move floats.
    q, g, u = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    np.testing.assert_array_equal(to_bf16(interleave_rope(kept[q], 16)), to_bf16(interleave_rope(as_float[q], 16)))
    np.testing.assert_array_equal(
        to_bf16(interleave_gate_up(kept[g], kept[u])), to_bf16(interleave_gate_up(as_float[g], as_float[u]))
    )


def test_arithmetic_on_kept_bits_raises(checkpoint):
    _, kept = load_artifact(checkpoint["gemma2"], bf16_as_stored=True)
    w = kept["model.norm.weight"]
    with pytest.raises((TypeError, ValueError)):
        _ = w + np.float32(1.0)
    with pytest.raises((TypeError, ValueError)):
        np.asarray(w, np.float32)


def test_fp8_quantizing_at_load_reads_floats(checkpoint):
    _, weights = load_artifact(checkpoint["qwen2"], fp8_as_stored=True, weight_format="fp8", bf16_as_stored=True)
    assert not any(bf16.is_bf16(w) for w in weights.values())


def test_only_a_backend_that_takes_bf16_is_given_them():
    from engine.config import EngineConfig
    from engine.loading import loader_options

    class Card:
        name, takes_fp8, takes_bf16 = "cuda", True, True

    class Host:
        name = "numpy"

    assert loader_options(EngineConfig(), Card())["bf16_as_stored"] is True
    assert "bf16_as_stored" not in loader_options(EngineConfig(), Host())


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_ggufs_half_matrices_stay_half(tmp_path, qtype):
    from engine.backends.cuda.weights import to_bf16
    from tests.loaders.tiny_gguf import write_quantized

    path = write_quantized(tmp_path / f"tiny-{qtype}.gguf", qtype)
    cfg, as_float = load_artifact(path)
    cfg2, kept = load_artifact(path, bf16_as_stored=True)
    assert cfg2 == cfg and kept.keys() == as_float.keys()
    q = "model.layers.0.self_attn.q_proj.weight"  # un-permuted from llama.cpp's row order on the way
    assert kept[q].dtype == (np.float16 if qtype == "F16" else bf16.BF16)
    assert kept["model.norm.weight"].dtype == np.float32  # vectors stay float32
    for name, w in kept.items():
        wide = bf16.to_float32(w) if bf16.is_bf16(w) else np.asarray(w, np.float32)
        np.testing.assert_array_equal(wide, as_float[name])
        np.testing.assert_array_equal(to_bf16(w), to_bf16(as_float[name]))
    _, q8 = load_artifact(path, bf16_as_stored=True, fp8_as_stored=True, weight_format="fp8")
    assert not any(bf16.is_bf16(w) or getattr(w, "dtype", None) == np.float16 for w in q8.values())


def test_the_vision_towers_padding_widens_kept_bf16_first():
    from engine.backends.cuda.vision import _pad

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    kept = bf16.from_bits((w.view(np.uint32) >> 16).astype(np.uint16))  # exact: small integers
    np.testing.assert_array_equal(_pad(kept, 4, 5), np.pad(w, ((0, 2), (0, 2))))


def test_the_engines_default_loader_hands_the_backends_options_through(checkpoint):
    """engine.loading's default loader with what loader_options gives the CUDA backend (fp8 and bf16 as
    stored): the bf16 tensors arrive kept (a loader that dropped or refused the options would make
    every CUDA load of a Hugging Face checkpoint fail, as it once did: TypeError at load)."""
    from engine.backends.cuda import CudaBackend
    from engine.config import EngineConfig
    from engine.loading import load_artifact as default_loader
    from engine.loading import loader_options

    kw = loader_options(EngineConfig(backend="cuda"), CudaBackend())
    assert kw.get("bf16_as_stored") and kw.get("fp8_as_stored")
    _, weights = default_loader(checkpoint["qwen2"], lambda done, total: None, **kw)
    assert weights and all(bf16.is_bf16(w) for w in weights.values())
