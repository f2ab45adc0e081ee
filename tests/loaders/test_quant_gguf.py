"""Every GGUF type of issue 14 on the numpy backend: K-quant and Q5 fixtures made by llama.cpp's
``llama-quantize`` (tests/fixtures/gguf/), the rest written by the ``gguf`` package here. The
loader's tensors equal ``gguf.quants.dequantize`` bit for bit, and the numpy backend's logits match
transformers' own GGUF loading (which dequantizes through the same package) of the same file."""

from __future__ import annotations

import numpy as np
import pytest

from engine.loaders import load_artifact
from tests.engine.test_hf_parity import greedy, load_backend, rel_err
from tests.loaders.tiny_gguf import FIXTURE_FILES, FIXTURES, HEADS, KV_HEADS, write_quantized

WRITTEN = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32")  # the gguf package quantizes these itself
# Issue 14 point 1: every type the numpy backend must load.
ISSUE_TYPES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"}
IDS = [104, 101, 108, 108, 111, 32, 257, 119, 111, 114, 108, 100, 258, 10]
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every test file: name -> path."""
    out = {name: FIXTURES / name for name in FIXTURE_FILES}
    tmp = tmp_path_factory.mktemp("gguf-types")
    for qtype in WRITTEN:
        out[f"tiny-{qtype}.gguf"] = write_quantized(tmp / f"tiny-{qtype}.gguf", qtype)
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (adjacent rotation pairs back to HF's two halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _reference(path) -> tuple[dict[str, np.ndarray], set[str]]:
    """The file's tensors through gguf.quants.dequantize alone, in HF naming; and its matrix types."""
    import gguf
    from gguf.quants import dequantize

    out, types = {}, set()
    for t in gguf.GGUFReader(str(path)).tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if len(t.shape) == 2:
            types.add(t.tensor_type.name)
        if t.name.startswith("blk."):
            _, i, short = t.name.split(".", 2)
            name = f"model.layers.{i}.{GGUF_TO_HF[short]}"
            if short == "attn_q.weight":
                w = _unpermute(w, HEADS)
            elif short == "attn_k.weight":
                w = _unpermute(w, KV_HEADS)
        else:
            name = GGUF_TO_HF[t.name]
        out[name] = w
    return out, types


def test_the_files_cover_every_type_of_the_issue(files):
    seen = set()
    for name, path in files.items():
        _, types = _reference(path)
        assert types == FIXTURE_FILES.get(name, {name[5:-5]}), name
        seen |= types
    assert seen == ISSUE_TYPES
    assert all(FIXTURES.joinpath(n).stat().st_size < 1 << 20 for n in FIXTURE_FILES)


def test_loader_tensors_equal_gguf_dequantize_bit_exact(files):
    for name, path in files.items():
        ref, _ = _reference(path)
        cfg, weights = load_artifact(path)
        assert not cfg.tie_word_embeddings and set(weights) == set(ref), name
        for tensor, w in weights.items():
            assert w.dtype == np.float32 and np.array_equal(w, ref[tensor]), (name, tensor)


@pytest.fixture(scope="module")
def transformers_logits(files):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def run(path) -> np.ndarray:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            return model(torch.tensor([IDS])).logits[0, -1].numpy()

    return run


def test_numpy_backend_logits_match_the_dequantized_reference(files, transformers_logits):
    f32 = None
    for name, path in sorted(files.items()):
        cfg, weights = load_artifact(path)
        ours, _ = greedy(load_backend(cfg, weights), IDS, 1, list(range(4)))
        theirs = transformers_logits(path)
        assert rel_err(ours, theirs) <= 1e-4, name
        if name == "tiny-F32.gguf":
            f32 = ours
    # Quantization moved the logits (the files differ), but not far from the float model's.
    for name in FIXTURE_FILES:
        cfg, weights = load_artifact(files[name])
        q, _ = greedy(load_backend(cfg, weights), IDS, 1, list(range(4)))
        assert 0 < np.abs(q - f32).max() and float(q @ f32 / np.linalg.norm(q) / np.linalg.norm(f32)) > 0.95, name
