"""FP8 (e4m3) on the CPU side: the encoding against torch's float8_e4m3fn, quantization at load,
and Hugging Face FP8 checkpoints (written here with torch) against transformers on the same values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.loaders import fp8
from engine.loaders.fp8 import Fp8Tensor, decode, encode, quantize_fp8

torch = pytest.importorskip("torch")


def _torch_codes(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_decode_matches_torch_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    theirs = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(decode(codes), theirs, equal_nan=True)
    assert decode(np.array([0x7E, 0x01, 0x7F], np.uint8)).tolist()[:2] == [448.0, 2.0**-9]


def test_encode_matches_torch_bit_exact_with_ties_and_subnormals():
    rng = np.random.default_rng(0)
    values = np.sort(np.unique(decode(np.arange(256, dtype=np.uint8))))
    values = values[np.isfinite(values)]
    mids = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)  # exact ties: to even
    x = np.concatenate(
        [
            *(rng.standard_normal(20000).astype(np.float32) * s for s in (1e-3, 0.05, 1, 30, 300)),
            values, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e4)),
        ]
    )  # fmt: skip
    x = np.clip(x, -448, 448)  # torch gives NaN past 464 where we saturate
    assert np.array_equal(encode(x), _torch_codes(x))
    assert encode(np.array([449, 1e30, -1e30, np.nan], np.float32)).tolist() == [0x7E, 0x7E, 0xFE, 0x7F]


@pytest.mark.parametrize("block", [None, 128, 32])
def test_quantize_fp8_scales_and_round_trip(block):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((200, 300)).astype(np.float32) * np.linspace(0.01, 3, 200, dtype=np.float32)[:, None]
    w[7] = 0  # an all-zero row (and tile) must not divide by zero
    t = quantize_fp8(w, block)
    assert t.data.dtype == np.uint8 and t.data.shape == (200, 300) and t.block == block
    assert t.scale.shape == ((200,) if block is None else (-(-200 // block), -(-300 // block)))
    assert t.nbytes == w.size + t.scale.nbytes
    s = t.scale_per_element()
    assert np.array_equal(t.data, encode(w / s))  # the bytes are the scaled values' e4m3 codes
    assert np.abs(t.data & 0x7F).max() == 0x7E  # each group's amax maps to 448
    err = np.abs(t.dequantize() - w)
    assert np.all(err <= np.abs(w) * 2.0**-4 + s * 2.0**-10)  # half an ulp of 3 mantissa bits, or subnormal
    assert not np.any(t.dequantize()[7])


def test_fp8_tensor_checks_its_shapes():
    with pytest.raises(ValueError, match="scale"):
        Fp8Tensor((4, 8), np.zeros((4, 8), np.uint8), np.ones(3, np.float32), None)
    with pytest.raises(ValueError, match="uint8"):
        Fp8Tensor((4, 8), np.zeros((4, 8), np.float32), np.ones(4, np.float32), None)


# --- Hugging Face FP8 checkpoints ------------------------------------------------------------

HIDDEN, FFN = 64, 80  # 80: partial 32-row tiles on the MLP


def _tiny_llama(path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # larger than the default init: logits that differ
    model.save_pretrained(path, safe_serialization=True)
    return model


def _write_fp8(model, path, scheme: str) -> dict:
    """``model`` as an FP8 checkpoint (torch's own e4m3 cast); returns the dequantized state dict."""
    from safetensors.torch import save_file

    state, dequant = {}, {}
    for name, w in model.state_dict().items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            state[name] = w.to(torch.bfloat16)
            dequant[name] = state[name].to(torch.float32)
            continue
        if scheme == "block":
            b, (out, k) = 32, w.shape
            tiles = torch.zeros(-(-out // b) * b, -(-k // b) * b)
            tiles[:out, :k] = w.abs()
            scale = tiles.reshape(-(-out // b), b, -1, b).amax(dim=(1, 3)) / 448
            full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:out, :k]
            state[name + "_scale_inv"] = scale
        elif scheme == "channel":
            full = w.abs().amax(dim=1, keepdim=True) / 448
            state[name + "_scale"] = full
        else:  # one scale for the tensor
            full = w.abs().max() / 448
            state[name + "_scale"] = full.reshape(())
        q = (w / full).to(torch.float8_e4m3fn)
        state[name] = q
        dequant[name] = q.to(torch.float32) * full
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scheme == "block":
        config["quantization_config"]["weight_block_size"] = [32, 32]
    (path / "config.json").write_text(json.dumps(config))
    return dequant


def _numpy_logits(cfg, weights, ids):
    from tests.engine.test_hf_parity import greedy, load_backend

    return greedy(load_backend(cfg, weights), ids, 1, list(range(4)))[0]


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_fp8_checkpoint_logits_match_transformers_on_the_dequantized_weights(tmp_path, scheme):
    from engine.loaders import load_artifact

    model = _tiny_llama(tmp_path)
    dequant = _write_fp8(model, tmp_path, scheme)
    model.load_state_dict(dequant)
    ids = [3, 17, 42, 5, 77, 12, 9]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, -1].numpy()
    cfg, weights = load_artifact(tmp_path)
    assert all(isinstance(w, np.ndarray) and w.dtype == np.float32 for w in weights.values())
    for name, w in dequant.items():
        assert np.array_equal(weights[name], w.numpy()), name  # bit-exact dequantization
    ours = _numpy_logits(cfg, weights, ids)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4

    # A backend that takes fp8 gets the bytes and scales as stored.
    _, stored = load_artifact(tmp_path, fp8_as_stored=True)
    q = stored["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(q, Fp8Tensor) and q.block == (32 if scheme == "block" else None)
    assert np.array_equal(q.dequantize(), dequant["model.layers.1.mlp.down_proj.weight"].numpy())
    assert isinstance(stored["model.embed_tokens.weight"], np.ndarray)
    _, as_bf16 = load_artifact(tmp_path, fp8_as_stored=True, weight_format="bf16")
    assert isinstance(as_bf16["model.layers.1.mlp.down_proj.weight"], np.ndarray)


def test_fused_fp8_tensor_splits_with_its_scales():
    w = np.random.default_rng(2).standard_normal((96, 64)).astype(np.float32)
    for block in (None, 32):
        t = quantize_fp8(w, block)
        parts = fp8.map_rows(t, lambda a: {"a": a[:64], "b": a[64:]})
        assert np.array_equal(np.concatenate([parts["a"].dequantize(), parts["b"].dequantize()]), t.dequantize())
    with pytest.raises(ValueError, match="tiles"):
        fp8.map_rows(quantize_fp8(w, 32), lambda a: {"a": a[:40], "b": a[40:]})


def test_unreadable_fp8_configs_are_refused(tmp_path):
    from engine.loaders.hf import config_from_hf

    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1}  # fmt: skip
    with pytest.raises(ValueError, match="e4m3"):
        config_from_hf({**base, "quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
    with pytest.raises(ValueError, match="square"):
        config_from_hf({**base, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}})


# --- model.weight_format ------------------------------------------------------------------------


def test_weight_format_fp8_quantizes_projections_at_load(tmp_path):
    from engine.loaders import load_artifact

    model = _tiny_llama(tmp_path)
    cfg, weights = load_artifact(tmp_path)
    _, q = load_artifact(tmp_path, fp8_as_stored=True, weight_format="fp8")
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            assert isinstance(q[name], Fp8Tensor) and q[name].block is None
            assert np.array_equal(q[name].data, quantize_fp8(w).data)
        else:
            assert np.array_equal(q[name], w), name
    deq = {n: t.dequantize() if isinstance(t, Fp8Tensor) else t for n, t in q.items()}
    ids = [1, 2, 3, 4, 5]
    a, b = _numpy_logits(cfg, weights, ids), _numpy_logits(cfg, deq, ids)
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.995
    del model


def test_weight_format_fp8_is_refused_where_the_backend_takes_no_fp8(tmp_path):
    from engine.config import EngineConfig
    from engine.loaders import load_artifact
    from engine.loading import load_model

    _tiny_llama(tmp_path)
    with pytest.raises(ValueError, match="model.weight_format"):
        load_artifact(tmp_path, weight_format="fp8")
    with pytest.raises(ValueError, match="model.weight_format 'fp8': the numpy backend"):
        load_model(EngineConfig(backend="numpy", weight_format="fp8"), tmp_path, served_id="t", max_context=64,
                   ram_budget=1 << 30, progress=lambda d, t: None, on_context=lambda n: None)  # fmt: skip


def test_weight_format_key_takes_only_its_values():
    from ignis_site.config import FIELDS, load, validate

    assert FIELDS["model.weight_format"].default == "auto"
    assert load(environ={"IGNIS_MODEL_WEIGHT_FORMAT": "fp8"})["model.weight_format"] == "fp8"
    with pytest.raises(ValueError, match="auto | bf16 | fp8"):
        validate({"model.weight_format": "int4"})


def test_fused_fp8_checkpoint_splits_with_its_scales(tmp_path):
    """phi3's fused qkv_proj and gate_up_proj in FP8 tiles: split into q/k/v and gate/up on tile bounds."""
    import transformers

    from engine.loaders import load_artifact
    from tests.engine.test_hf_parity import _tiny_checkpoint

    _tiny_checkpoint("phi3", tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    dequant = _write_fp8(model, tmp_path, "block")
    model.load_state_dict(dequant)
    ids = [5, 9, 200, 31, 7]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, -1].numpy()
    cfg, weights = load_artifact(tmp_path)
    ours = _numpy_logits(cfg, weights, ids)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4
    _, stored = load_artifact(tmp_path, fp8_as_stored=True)
    qkv = dequant["model.layers.0.self_attn.qkv_proj.weight"].numpy()
    k = stored["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k, Fp8Tensor) and k.shape == (32, 64) and k.scale.shape == (1, 2)
    assert np.array_equal(k.dequantize(), qkv[64:96])
    up = stored["model.layers.1.mlp.up_proj.weight"]
    assert np.array_equal(up.dequantize(), dequant["model.layers.1.mlp.gate_up_proj.weight"].numpy()[128:])
