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


# --- split regexes by tokenizer.ggml.pre -------------------------------------------------

# Hand-derived splits where the families disagree: digit runs, case changes, contractions.
EXPECTED_SPLITS = {
    "12345": {"llama-bpe": ["123", "45"], "gpt-4o": ["123", "45"], "qwen2": list("12345"), "tekken": list("12345")},
    "helloWorld": {
        "llama-bpe": ["helloWorld"],
        "qwen2": ["helloWorld"],
        "gpt-4o": ["hello", "World"],
        "tekken": ["hello", "World"],
    },
    "don't": {
        "llama-bpe": ["don", "'t"],
        "qwen2": ["don", "'t"],
        "gpt-4o": ["don't"],
        "tekken": ["don", "'t"],  # the apostrophe is the optional lead of the next word
    },
    "it'S": {"llama-bpe": ["it", "'S"], "qwen2": ["it", "'S"], "gpt-4o": ["it'S"], "tekken": ["it", "'S"]},
    "HTTPServer": {name: ["HTTPServer"] for name in ("llama-bpe", "qwen2", "gpt-4o", "tekken")},
    "x\n\n  y": {name: ["x", "\n\n", " ", " y"] for name in ("llama-bpe", "qwen2", "gpt-4o", "tekken")},
}
SPLIT_SAMPLE = (
    "I'm HTTPServer's helloWorld; DON'T stop 1234567 3.14\n\n  indented\tTab  spaces   end "
    "naïve Ünïcode ΣΊΣΥΦΟΣ 日本語 🎉👍🏽 a/b//c?!/ x--y\r\n"
)


def _gpt2_vocab_tokenizer(pre: str):
    """A byte-level tokenizer with only the 256 byte tokens, as a GGUF with ``pre`` would build it."""
    from engine.tokenizer_gguf import GGUFVocab, build_gguf_tokenizer, byte_alphabet

    tokens = list(byte_alphabet().values())
    return build_gguf_tokenizer(GGUFVocab(model="gpt2", tokens=tokens, types=[1] * 256, merges=[], pre=pre))


def _splits(tok, text: str) -> list[str]:
    from engine.tokenizer_gguf import byte_alphabet

    unspell = {c: b for b, c in byte_alphabet().items()}
    return [bytes(unspell[c] for c in piece).decode() for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "tekken"])
def test_pre_name_picks_its_split(pre):
    tok = _gpt2_vocab_tokenizer(pre)
    for text, by_name in EXPECTED_SPLITS.items():
        assert _splits(tok, text) == by_name[pre], (pre, text)
    # The tokenizers engine and Python's regex module read the pattern alike, and no byte is lost.
    regex = pytest.importorskip("regex")
    from engine.tokenizer_gguf import PRE_SPLITS

    assert _splits(tok, SPLIT_SAMPLE) == regex.findall(PRE_SPLITS[pre], SPLIT_SAMPLE)
    assert "".join(_splits(tok, SPLIT_SAMPLE)) == SPLIT_SAMPLE


def test_new_models_pre_names_are_mapped():
    from engine.tokenizer_gguf import PRE_SPLITS

    # qwen3 (qwen2), gpt-oss and llama 4 (gpt-4o, o200k), mistral nemo (tekken), llama 3 / phi4 via dbrx.
    assert PRE_SPLITS["qwen2"] != PRE_SPLITS["gpt-4o"] != PRE_SPLITS["tekken"]
    assert PRE_SPLITS["llama4"] == PRE_SPLITS["gpt-4o"] and PRE_SPLITS["dbrx"] == PRE_SPLITS["llama-bpe"]
    # A name with no entry splits as GPT-2 does (smollm's default model relies on it).
    assert _splits(_gpt2_vocab_tokenizer("smollm"), "12345 don't") == ["12345", " don", "'t"]


def test_unsupported_tokenizer_model_is_refused():
    from engine.tokenizer_gguf import GGUFVocab, build_gguf_tokenizer

    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert'"):
        build_gguf_tokenizer(GGUFVocab(model="bert", tokens=["a"], types=[1]))


# --- stop tokens and Hugging Face directories ----------------------------------------------


def _word_tokenizer(specials: list[str]):
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return tok


def test_harmony_stops_at_return_and_call_never_end():
    from engine.tokenizer import stop_token_ids

    tok = _word_tokenizer(
        ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
    )
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|end|>", "<|return|>", "<|call|>")}
    template = "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"  # past turns end in <|end|>
    # Even a file naming <|end|> its EOS does not stop the analysis channel from handing over to the final one.
    stops = stop_token_ids(tok, [ids["<|end|>"], ids["<|endoftext|>"]], template)
    assert set(stops) == {ids["<|endoftext|>"], ids["<|return|>"], ids["<|call|>"]}


@pytest.mark.parametrize(
    "end, template",
    [
        ("<|end|>", "<|user|>\n{{ m.content }}<|end|>\n<|assistant|>\n"),  # phi3
        ("<|im_end|>", "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"),  # qwen2/3
        ("<end_of_turn>", "<start_of_turn>user\n{{ m.content }}<end_of_turn>\n"),  # gemma
    ],
)
def test_end_of_turn_tokens_the_template_uses_stop(end, template):
    from engine.tokenizer import stop_token_ids

    tok = _word_tokenizer(["</s>", end])
    eos = tok.token_to_id("</s>")
    assert stop_token_ids(tok, [eos, None, eos], template) == (eos, tok.token_to_id(end))
    assert stop_token_ids(tok, [eos], "{{ m.content }}") == (eos,)  # a template without it: EOS only


def test_directory_named_templates_and_generation_config(tmp_path):
    import json

    tok = _word_tokenizer(["<s>", "</s>", "<|im_end|>", "<|return|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    named = [
        {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": named, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    bundle = load_tokenizer(tmp_path)
    assert bundle.chat_template == named[0]["template"] and bundle.template_for(tools=False) == named[0]["template"]
    assert bundle.template_for(tools=True) == named[1]["template"]
    # </s>, generation_config's ids, then <|im_end|> because the default template uses it.
    assert bundle.eos_token_ids == (3, 2, 4) and bundle.add_bos and not bundle.add_eos
    assert bundle.encode("hi", add_special_tokens=True) == [2, 1]
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")  # the file wins over the config
    assert load_tokenizer(tmp_path).chat_template == "{{ messages[0].content }}"


def test_harmony_template_alone_marks_harmony():
    from engine.tokenizer import stop_token_ids

    tok = _word_tokenizer(["<|end|>", "<|return|>"])  # a vocabulary without <|call|>
    template = "<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>"
    assert stop_token_ids(tok, [], template) == (tok.token_to_id("<|return|>"),)
    assert stop_token_ids(tok, [], "<|user|>{{ m.content }}<|end|>") == (tok.token_to_id("<|end|>"),)
