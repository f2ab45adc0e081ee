"""The tiny llama-shaped GGUF behind the K-quant fixtures (tests/fixtures/gguf/README.md).

Every matrix row holds whole K-quant super-blocks (256 values): hidden 256, 4
heads of 64 (2 KV heads), FFN 512, one layer, a byte-level vocabulary of 259
tokens (GPT-2's 256 byte characters and three ChatML specials) and an untied
output head (with a tied one, a one-layer model repeats its input). ``write_base``
writes it in F32 as llama.cpp's converter would (q/k rows permuted); the
fixtures are ``llama-quantize`` runs over that file, and ``write_quantized``
makes the types the ``gguf`` package quantizes itself (Q8_0, Q4_0, Q4_1, F16,
BF16, F32) at test time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
# File -> the GGML types its matrices hold (llama-quantize's mixes for the _M files).
FIXTURE_FILES = {
    "tiny-Q4_K_M.gguf": {"Q4_K", "Q6_K"},
    "tiny-Q5_K_M.gguf": {"Q5_K", "Q6_K"},
    "tiny-Q6_K.gguf": {"Q6_K"},
    "tiny-Q5_0.gguf": {"Q5_0"},
    "tiny-Q5_1.gguf": {"Q5_1"},
}
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 1
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (HF rotate_half pairs -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in GGUF naming, q/k already permuted as a converter writes them."""
    from engine.tokenizer_gguf import byte_alphabet

    rng = np.random.default_rng(seed)
    vocab = len(byte_alphabet()) + len(SPECIALS)
    head_dim = HIDDEN // HEADS

    def mat(out: int, k: int) -> np.ndarray:
        return (rng.standard_normal((out, k)) / np.sqrt(k)).astype(np.float32)

    w = {
        "token_embd.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32),
        "output_norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "output.weight": mat(vocab, HIDDEN) * 4,
    }
    for i in range(LAYERS):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "attn_q.weight"] = llama_cpp_permute(mat(HEADS * head_dim, HIDDEN), HEADS)
        w[p + "attn_k.weight"] = llama_cpp_permute(mat(KV_HEADS * head_dim, HIDDEN), KV_HEADS)
        w[p + "attn_v.weight"] = mat(KV_HEADS * head_dim, HIDDEN)
        w[p + "attn_output.weight"] = mat(HIDDEN, HEADS * head_dim)
        w[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "ffn_gate.weight"] = mat(FFN, HIDDEN)
        w[p + "ffn_up.weight"] = mat(FFN, HIDDEN)
        w[p + "ffn_down.weight"] = mat(HIDDEN, FFN)
    return w


def _writer(path: Path):
    import gguf

    from engine.tokenizer_gguf import byte_alphabet

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("ignis-tiny-kquant")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)] + SPECIALS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    return w


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_base(path: Path, seed: int = 0) -> Path:
    """The F32 file ``llama-quantize`` starts from."""
    w = _writer(path)
    for name, t in tiny_weights(seed).items():
        w.add_tensor(name, t)
    _finish(w)
    return path


def write_quantized(path: Path, qtype: str, seed: int = 0) -> Path:
    """The tiny model with every matrix in ``qtype`` by the ``gguf`` package (Q8_0, Q4_0, Q4_1, F16, BF16, F32)."""
    import gguf
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType[qtype]
    w = _writer(path)
    for name, x in tiny_weights(seed).items():
        if x.ndim == 2 and qtype in ("F32", "F16"):
            w.add_tensor(name, x.astype(np.float16 if qtype == "F16" else np.float32))
        elif x.ndim == 2:
            w.add_tensor(name, quantize(x, t), raw_dtype=t)
        else:
            w.add_tensor(name, x)
    _finish(w)
    return path


if __name__ == "__main__":  # python -m tests.loaders.tiny_gguf OUT.gguf: the base file for llama-quantize
    import sys

    print(write_base(Path(sys.argv[1])))
