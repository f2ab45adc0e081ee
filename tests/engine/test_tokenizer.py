"""Our tokenizers give the ids transformers gives; incremental detokenizing never splits a character."""

from __future__ import annotations

import pytest

from engine.tokenizer import IncrementalDetokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    " leading space, and  two   spaces",
    "tabs\tand\t\ttabs, CRLF\r\nnew lines\n\n\nend ",
    "Ünïcödé: café, naïve, Straße, ĳ, Ω≈ç√∫",
    "emoji 🎉👩‍👩‍👧 flags 🇫🇷 and 👍🏽!",
    "日本語のテキスト、中文字符，한국어",
    "digits 1234567890 3.14159 x2 1,000,000 2024-06-01",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "code:\n    def f(x):\n\t\treturn x ** 2  # done\r\n",
    "    ",
    "",
]


@pytest.fixture(scope="module")
def gguf_bundle(default_gguf_path):
    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(default_gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(gguf_bundle, hf_gguf_tokenizer):
    for text in TEXTS:
        assert gguf_bundle.encode(text) == hf_gguf_tokenizer.encode(text, add_special_tokens=False), repr(text)
        ids = gguf_bundle.encode(text)
        assert gguf_bundle.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_directory_tokenizer_matches_transformers(hf_gguf_tokenizer, tmp_path):
    import transformers

    hf_gguf_tokenizer.save_pretrained(tmp_path)  # tokenizer.json + tokenizer_config.json (+ chat template)
    ours = load_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), repr(text)
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), repr(text)
    assert ours.chat_template == theirs.chat_template
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert theirs.convert_tokens_to_ids("<|im_end|>") in ours.eos_token_ids


def test_gguf_metadata_tokens(gguf_bundle):
    assert gguf_bundle.bos_token == "<|im_start|>" and gguf_bundle.eos_token == "<|im_end|>"
    assert gguf_bundle.eos_token_ids == (2,) and not gguf_bundle.add_bos
    assert "<|im_start|>" in gguf_bundle.chat_template
    # Control tokens stay whole instead of being cut into pieces.
    assert gguf_bundle.encode("<|im_start|>user") == [1, *gguf_bundle.encode("user")]
    assert gguf_bundle.decode(gguf_bundle.encode("<|im_end|>ok")) == "ok"


def test_incremental_detokenizer_reassembles_split_emoji(gguf_bundle):
    text = "Party 🎉👩‍👩‍👧 time, ça va? 日本"
    ids = gguf_bundle.encode(text)
    # The point of the test: some single tokens are incomplete UTF-8 on their own.
    assert any("\ufffd" in gguf_bundle.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(gguf_bundle)
    pieces = [detok.feed([i]) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text


def test_incremental_detokenizer_rounds_and_prompt_context(gguf_bundle):
    prompt = gguf_bundle.encode("<|im_start|>assistant\n")
    ids = gguf_bundle.encode(" Hello there, 👋 friend")
    detok = IncrementalDetokenizer(gguf_bundle, prompt_ids=prompt)
    # Several ids per round, as the engine sends them.
    out = "".join(detok.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert out == " Hello there, 👋 friend"
