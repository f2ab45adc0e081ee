"""MXFP4 kept as stored (engine/loaders/mxfp4.py): ``Mxfp4Tensor`` against the float dequantization,
llama.cpp's blocks against the ``gguf`` package's own dequantize, and a tiny gpt-oss (safetensors,
sharded, GGUF) loaded for a backend that takes MXFP4: each expert an ``Mxfp4Tensor [out, in]``
holding exactly the float path's values, every other tensor as before."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.loaders import load_artifact
from engine.loaders.mxfp4 import Mxfp4Tensor, dequantize, dequantize_hf, from_ggml
from engine.loading import loader_options
from engine.models import definition
from tests.models.tiny_gpt_oss import ggml_mxfp4, quantize_experts_mxfp4, write_checkpoint, write_gguf

# e8m0 bytes at the edges (2^-127, 2^-126, 1/2, 1, 2^73, e8m0's NaN: inf in the float path) among ordinary ones.
SCALES = np.array([0, 1, 126, 127, 200, 255, *range(110, 135)], np.uint8)
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def _random(rows: tuple[int, ...], groups: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*rows, groups, 16), dtype=np.uint8)  # every nibble, both orders
    return blocks, rng.choice(SCALES, (*rows, groups))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def test_tensor_is_the_float_dequantization_and_indexes_like_it():
    blocks, scales = _random((3, 40), 2)
    t = Mxfp4Tensor(blocks, scales)
    full = dequantize(blocks, scales)  # [3, 40, 64]
    assert t.shape == (3, 40, 64) and t.nbytes == blocks.nbytes + scales.nbytes
    np.testing.assert_array_equal(_bits(t.dequantize()), _bits(full))
    np.testing.assert_array_equal(_bits(t.dequantize()), _bits(dequantize_hf(blocks, scales).swapaxes(-1, -2)))
    picks = [slice(0, None, 2), slice(1, None, 2), slice(5, 17), np.array([39, 0, 7, 7, 12])]
    for e in range(3):
        assert t[e].shape == (40, 64)
        np.testing.assert_array_equal(_bits(t[e].dequantize()), _bits(full[e]))
        for index in picks:
            part = t[e].rows(index)
            assert np.shares_memory(part.blocks, t.blocks) == isinstance(index, slice)  # a slice: a view, no copy
            np.testing.assert_array_equal(_bits(part.dequantize()), _bits(full[e][index]))
    np.testing.assert_array_equal(_bits(t.rows(picks[-1]).dequantize()), _bits(full[:, picks[-1]]))


def test_tensor_refuses_arrays_that_are_not_blocks_and_their_scales():
    with pytest.raises(ValueError, match="do not match"):
        Mxfp4Tensor(np.zeros((4, 2, 16), np.uint8), np.zeros((4, 3), np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        Mxfp4Tensor(np.zeros((4, 2, 17), np.uint8), np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        Mxfp4Tensor(np.zeros((4, 2, 16), np.int8), np.zeros((4, 2), np.uint8))


@pytest.mark.parametrize("shape", [(40, 64), (3, 40, 96)])
def test_ggml_blocks_dequantize_as_gguf_does(shape):
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    *rows, k = shape
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (*rows, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.choice(SCALES, raw.shape[:-1])
    raw = raw.reshape(*rows, -1)  # as the reader gives it: each row its blocks' bytes
    t = from_ggml(raw, shape)
    assert t.shape == shape
    with np.errstate(over="ignore"):  # scale 255: inf, in gguf's product as in our ldexp
        theirs = gguf_dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(shape)
    np.testing.assert_array_equal(t.dequantize(), theirs)  # values: ggml's table writes code 8 (-0) as +0


def test_ggml_blocks_are_the_checkpoints_bytes_regrouped():
    blocks, scales = _random((3, 40), 2, seed=2)
    t = from_ggml(ggml_mxfp4(blocks, scales), (3, 40, 64))
    np.testing.assert_array_equal(t.blocks, blocks)  # byte for byte: -0 (code 8) is not +0 (code 0) here
    np.testing.assert_array_equal(t.scales, scales)
    with pytest.raises(ValueError, match="whole blocks"):
        from_ggml(np.zeros(17, np.uint8), (1, 48))


def test_only_a_backend_that_takes_mxfp4_is_given_them():
    class Card:
        name, takes_fp8, takes_mxfp4 = "cuda", True, True

    class Host:
        name = "numpy"

    assert loader_options(EngineConfig(), Card())["mxfp4_as_stored"] is True
    assert loader_options(EngineConfig(weight_format="bf16"), Card())["weight_format"] == "bf16"
    assert "mxfp4_as_stored" not in loader_options(EngineConfig(), Host())


# --- a tiny gpt-oss ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny gpt-oss with MXFP4 experts, scale bytes over 0..252 (past 252 a block's 6 overflows float32)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = write_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "hf")
    quantize_experts_mxfp4(path, scales=(0, 253))
    return path


def _assert_kept(cfg, kept: dict, floats: dict, *, zero_signs: bool = True) -> set[str]:
    """Every expert matrix an Mxfp4Tensor of its canonical shape whose values are, bit for bit, the
    float path's (``zero_signs`` False: equal as values, -0 == +0); every other tensor the float
    path's. Returns the experts' names."""
    shapes = definition("gpt_oss").tensors(cfg)
    assert kept.keys() == floats.keys() == shapes.keys()
    experts = {n for n in kept if EXPERT.fullmatch(n)}
    assert len(experts) == cfg.num_layers * cfg.num_experts * 3
    for name, w in kept.items():
        if name in experts:
            assert isinstance(w, Mxfp4Tensor) and w.shape == shapes[name], name
            w = w.dequantize()
            if not zero_signs:
                np.testing.assert_array_equal(w, floats[name], err_msg=name)
                continue
        np.testing.assert_array_equal(_bits(w), _bits(floats[name]), err_msg=name)
    return experts


def test_checkpoint_experts_are_kept_for_a_backend_that_takes_them(checkpoint):
    from engine.loading import load_artifact as default_loader

    class Card:
        name, takes_fp8, takes_mxfp4 = "cuda", True, True

    cfg, floats = load_artifact(checkpoint)
    assert not any(isinstance(w, Mxfp4Tensor) for w in floats.values())
    kept_cfg, kept = default_loader(checkpoint, lambda done, total: None, **loader_options(EngineConfig(), Card()))
    assert kept_cfg == cfg
    _assert_kept(cfg, kept, floats)
    _, dequantized = load_artifact(checkpoint, mxfp4_as_stored=True, weight_format="bf16")
    assert not any(isinstance(w, Mxfp4Tensor) for w in dequantized.values())


def test_pairs_split_across_shards_are_kept(checkpoint, tmp_path):
    """Blocks before their scales and scales before their blocks, in different files."""
    from safetensors.numpy import load_file, save_file

    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    first, second = files.values()
    for name, t in load_file(checkpoint / "model.safetensors").items():
        (first if name.endswith(("down_proj_scales", "gate_up_proj_blocks")) else second)[name] = t
    index = {name: file for file, tensors in files.items() for name in tensors}
    for file, tensors in files.items():
        save_file(tensors, tmp_path / file, metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    cfg, floats = load_artifact(checkpoint)
    _, kept = load_artifact(tmp_path, mxfp4_as_stored=True)
    _assert_kept(cfg, kept, floats)


def test_a_ggufs_mxfp4_experts_are_kept_when_named(checkpoint, tmp_path):
    """llama.cpp's stacked MXFP4 experts: as stored, the same bytes as the safetensors checkpoint's;
    the float path still dequantizes them (GGML type 39) for every other backend."""
    path = tmp_path / "tiny.gguf"
    write_gguf(checkpoint, path, mxfp4=True)
    cfg, floats = load_artifact(path)
    _, kept = load_artifact(path, as_stored=["MXFP4"])
    _, from_hf = load_artifact(checkpoint, mxfp4_as_stored=True)
    for name in _assert_kept(cfg, kept, floats, zero_signs=False):  # values: ggml's table has no -0
        np.testing.assert_array_equal(kept[name].blocks, from_hf[name].blocks, err_msg=name)
        np.testing.assert_array_equal(kept[name].scales, from_hf[name].scales, err_msg=name)
    _, cpu = load_artifact(path, as_stored=True)  # the cpu backend's types: MXFP4 is not among them
    assert not any(isinstance(w, Mxfp4Tensor) for w in cpu.values())
