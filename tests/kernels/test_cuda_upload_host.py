"""The uploader's pinned staging path (engine/backends/cuda/pinned.py) puts on the device the bytes
the direct path puts there, at the same addresses, for small random bf16 checkpoints of the
layouts it permutes: rope-interleaved q|k|v (qwen2's biases beside them, phi3's partial rotary
and fused tensors), gate|up in 8-row groups or plain, gemma2's ``1 + w`` norms. Runs without a
card: pycuda.driver is tests/kernels/fake_pycuda.py (its asynchronous copies read their pinned
source only when waited for, so a buffer refilled too early shows). The last tests need a card."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from engine.loaders import bf16, load_artifact
from tests.kernels import fake_pycuda
from tests.kernels.gpu import gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip
ARCHS = ("llama", "llama_odd", "qwen2", "gemma2", "phi3")


def _model(arch: str):
    tf = transformers
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=64, **DIMS))
    if arch == "llama_odd":  # I % 8 != 0: gate then up, not interleaved
        return tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=64, **{**DIMS, "intermediate_size": 300}))
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(tie_word_embeddings=False, **DIMS))
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=64, **DIMS))
    if arch == "phi3":  # fused qkv and gate_up, rotary over 48 of 64 dims
        return tf.Phi3ForCausalLM(tf.Phi3Config(partial_rotary_factor=0.75, sliding_window=None, **DIMS))
    raise ValueError(arch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = _model(arch)
        with torch.no_grad():  # norms off their constant init, so a misplaced one shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.5)
        path = tmp_path_factory.mktemp(arch)
        model.to(torch.bfloat16).save_pretrained(path)
        out[arch] = path
    return out


def _upload(cfg, weights, pinned: bool, packed: bool = False):
    """DeviceWeights and the fake device's allocations, by address (``packed``: back to back)."""
    from engine.backends.cuda.weights import upload
    from engine.cu.runtime import Allocations
    from engine.models import definition

    defn = definition(cfg.arch)
    with fake_pycuda.installed(fake_pycuda.Device(packed=packed)) as device:
        w = upload(cfg, defn.blocks(cfg), defn.head(cfg), weights, Allocations(), pinned=pinned)
    return w, device


@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
@pytest.mark.parametrize("small_buffers", [False, True], ids=["256MB", "96KB"])
@pytest.mark.parametrize("arch", ARCHS)
def test_pinned_staging_puts_the_direct_paths_bytes(checkpoints, arch, small_buffers, packed, monkeypatch):
    """``packed``: allocations back to back, as the card placed them (its copies spanning two
    tensors were refused, invalid argument, until the copier stopped merging across tensors)."""
    from engine.backends.cuda import pinned

    if small_buffers:  # many buffer turns, tensors split across them, chunks of one head (32 KB) or a few rows
        monkeypatch.setattr(pinned, "BUFFER_BYTES", 96 << 10)
        monkeypatch.setattr(pinned, "CHUNK_BYTES", 16 << 10)
    fits = pinned.PinnedCopier.fits
    taken = []
    monkeypatch.setattr(pinned.PinnedCopier, "fits", lambda self, runs: taken.append(fits(self, runs)) or taken[-1])
    cfg, weights = load_artifact(checkpoints[arch], bf16_as_stored=True, fp8_as_stored=True)
    assert all(bf16.is_bf16(w) for w in weights.values())
    assert_same_upload(cfg, weights, packed)
    assert taken and all(taken)  # no bf16 tensor fell back to the direct path


def test_a_bf16_gguf_goes_up_the_same(tmp_path):
    from tests.loaders.tiny_gguf import write_quantized

    cfg, weights = load_artifact(write_quantized(tmp_path / "tiny-BF16.gguf", "BF16"), bf16_as_stored=True)
    assert any(bf16.is_bf16(w) for w in weights.values())
    assert_same_upload(cfg, weights)


def assert_same_upload(cfg, weights, packed: bool = False) -> None:
    """The pinned path's DeviceWeights and device bytes are the direct path's."""
    direct, dev_direct = _upload(cfg, weights, pinned=False, packed=packed)
    staged, dev_staged = _upload(cfg, weights, pinned=True, packed=packed)
    assert staged == direct and staged.nbytes == direct.nbytes
    assert dev_direct.async_copies == 0 and dev_staged.async_copies > 0
    a, b = dev_direct.contents(), dev_staged.contents()
    assert a.keys() == b.keys()
    for ptr in a:
        assert a[ptr] == b[ptr], f"allocation at {ptr:#x} differs"
    assert any(x.strip(b"\0") for x in b.values())


def test_the_loader_maps_bf16_tensors_read_only(checkpoints):
    _, weights = load_artifact(checkpoints["qwen2"], bf16_as_stored=True)
    w = weights["model.layers.0.self_attn.o_proj.weight"]
    assert bf16.is_bf16(w) and not w.flags.writeable  # a view of the mapped file, not a copy


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("rotary", [64, 48, 16])
def test_rope_runs_match_interleave_rope(rotary, strided):
    from engine.backends.cuda.pinned import runs
    from engine.backends.cuda.weights import interleave_rope, to_bf16

    bits = np.random.default_rng(rotary).integers(0, 1 << 16, (3 * 64, 56), dtype=np.uint16)
    bits = bits[:, 8:48] if strided else bits[:, :40].copy()  # strided: columns of a wider tensor
    w = bf16.from_bits(bits)
    (run,) = runs([w], rope_dim=64, rotary_dim=rotary)
    out = np.zeros(run.units * run.unit_bytes // 2, np.uint16)
    run.write(0, 1, out[: run.unit_bytes // 2])
    run.write(1, 3, out[run.unit_bytes // 2 :])
    np.testing.assert_array_equal(out.reshape(bits.shape), to_bf16(interleave_rope(w, 64, rotary)))


def test_cuda_pinned_upload_key_reaches_the_uploader(monkeypatch):
    """``cuda.pinned_upload`` (on by default since the card ran the tests below) reaches CudaTuning,
    and the backend's load hands it to ``upload``."""
    import inspect

    from engine.backends.cuda import backend
    from engine.config import CudaTuning
    from ignis_site import config

    assert config.FIELDS["cuda.pinned_upload"].default is True and CudaTuning().pinned_upload is True
    values, _ = config.resolve(environ={"IGNIS_CUDA_PINNED_UPLOAD": "off"})
    assert CudaTuning(**config.cuda_tuning_dict(values)).pinned_upload is False
    assert "pinned=self.tuning.pinned_upload" in inspect.getsource(backend.CudaBackend._load)


def test_a_failed_upload_raises(checkpoints):
    cfg, weights = load_artifact(checkpoints["llama"], bf16_as_stored=True)
    del weights["model.norm.weight"]
    with pytest.raises(KeyError):
        _upload(cfg, weights, pinned=True)


# --- on a card ---------------------------------------------------------------------------------


def _device_bytes(mem) -> list[bytes]:
    import pycuda.driver as cuda

    out = []
    for a, n in mem._allocs:
        host = np.empty(n, np.uint8)
        cuda.memcpy_dtoh(host, int(a))
        out.append(host.tobytes())
    return out


@gpu
@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "phi3"])
def test_on_the_card_the_pinned_path_uploads_the_direct_paths_bytes(checkpoints, arch, monkeypatch):
    from engine.backends.cuda import pinned
    from engine.backends.cuda.weights import upload
    from engine.cu import runtime
    from engine.cu.runtime import Allocations
    from engine.models import definition

    monkeypatch.setattr(pinned, "BUFFER_BYTES", 64 << 10)  # many buffer turns on a small model
    monkeypatch.setattr(pinned, "CHUNK_BYTES", 8 << 10)
    cfg, weights = load_artifact(checkpoints[arch], bf16_as_stored=True, fp8_as_stored=True)
    defn = definition(cfg.arch)
    with runtime.current():
        got = []
        for is_pinned in (False, True):
            mem = Allocations()
            try:
                upload(cfg, defn.blocks(cfg), defn.head(cfg), weights, mem, pinned=is_pinned)
                got.append(_device_bytes(mem))
            finally:
                mem.free()
    assert got[0] == got[1]


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_a_load_through_the_pinned_path_runs_as_the_direct_one(checkpoints, arch, monkeypatch):
    from engine.backends.cuda import weights as uploader
    from tests.kernels.test_cuda_bf16_load import prefill_each

    cfg, weights = load_artifact(checkpoints[arch], bf16_as_stored=True, fp8_as_stored=True)
    (staged,) = prefill_each(cfg, (weights,), 37, seed=3)
    monkeypatch.setattr(uploader, "upload", functools.partial(uploader.upload, pinned=False))
    (direct,) = prefill_each(cfg, (weights,), 37, seed=3)
    np.testing.assert_array_equal(staged, direct)
