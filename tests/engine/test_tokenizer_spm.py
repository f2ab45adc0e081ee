"""A GGUF ``llama`` (SentencePiece) vocabulary tokenizes as the model's own Hugging Face tokenizer does.

No network, so the SentencePiece-style model is made here: a BPE trained with
``tokenizers`` gives the pieces and their order; the source tokenizer is laid
out as llama 2's and gemma's ``tokenizer.json`` are (byte fallback, ``▁`` for
spaces, merges for every cut of a piece as transformers derives them from a
SentencePiece model); the GGUF is written as llama.cpp's converter writes one
(pieces, scores, token types, no merges). A direct implementation of
SentencePiece's merge loop (best-scoring adjacent pair first, leftmost on a
tie) is a third opinion on text without special tokens.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from engine.tokenizer_gguf import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

gguf = pytest.importorskip("gguf")
generate_merges = pytest.importorskip("transformers.tokenization_utils_base").generate_merges

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.",
    "Hello world! Hello there, how are you today? I am fine, thank you very much.",
    "def tokenize(text):\n    return [piece for piece in text.split()]\n\nprint(tokenize('a b c'))",
    "Les élèves étudient la théorie; naïve café crème, déjà vu. Straße und Größe.",
    "Numbers 12345 and 3.14159 and 2024-06-01, then 1,000,000 people in the room.",
    "Ask the model a question [INST] and wait [/INST] for its answer to come back.",
] * 3

TEXTS = [
    "Hello world",
    "The fox, the dog and the theory of everything.",
    " leading space",
    "  two leading spaces and  inner   runs",
    "new\nlines\n\n and\ttabs\r\n",
    "Ünïcödé café naïve Straße Ω≈ç√∫",
    "emoji 🎉👩‍👩‍👧 needs bytes 🇫🇷 👍🏽",
    "日本語のテキスト、中文",
    "def f(x):\n    return x ** 2",
    "<0x41> is text, not a byte",
    "    ",
    "",
]
WITH_SPECIALS = [
    "<s>[INST] What is 2+2? [/INST]",
    "[INST]hi[/INST] Four.</s>",
    "a<tool>b <tool> c",
    "</s></s> end",
]
SPACE = "\u2581"


def _pieces(vocab_size: int = 420) -> list[str]:
    """Pieces in merge order (most frequent merge first), then the characters seen."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", SPACE)
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    merged = ["".join(m) for m in trained.model.get_merges()] if hasattr(trained.model, "get_merges") else None
    if merged is None:  # older tokenizers: the merges live only in the serialized model
        import json

        merged = [
            "".join(m if isinstance(m, list) else m.split(" ")) for m in json.loads(trained.to_str())["model"]["merges"]
        ]
    chars = sorted((t for t in trained.get_vocab() if len(t) == 1), key=trained.get_vocab().get)
    seen: dict[str, None] = {}
    for piece in merged + chars:
        seen.setdefault(piece, None)
    return list(seen)


def _vocab(pieces, *, control, extra=()):
    """(tokens, types, scores) the way llama.cpp's converter lays out a SentencePiece model."""
    tokens = ["<unk>", "<s>", "</s>", *control]
    types = [UNKNOWN, CONTROL, CONTROL, *[CONTROL] * len(control)]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    for token, ty in extra:
        tokens.append(token)
        types.append(ty)
    tokens += pieces
    types += [NORMAL] * len(pieces)
    # SentencePiece BPE scores its pieces by merge order; specials and bytes score 0.
    scores = [0.0 if ty != NORMAL else -float(i) for i, ty in enumerate(types)]
    return tokens, types, scores


def _shuffled(tokens, types, scores, seed=0):
    """The pieces in another order in the file, each keeping its score: the score, not the id, must rank merges."""
    at = [i for i, ty in enumerate(types) if ty == NORMAL]
    order = at[:]
    random.Random(seed).shuffle(order)
    tokens, scores = list(tokens), list(scores)
    moved = [(tokens[j], scores[j]) for j in order]
    for i, (t, sc) in zip(at, moved):
        tokens[i], scores[i] = t, sc
    return tokens, list(types), scores


def _source(tokens, types, scores, *, prefix: bool) -> Tokenizer:
    """The model's own tokenizer.json: llama 2's layout (``prefix``) or gemma's (no prefix space)."""
    ids = {t: i for i, t in enumerate(tokens)}
    pieces = {t: ids[t] for t, ty in zip(tokens, types) if ty == NORMAL}
    merges = generate_merges(pieces, {t: scores[i] for t, i in pieces.items()})
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend(SPACE)] if prefix else []), normalizers.Replace(" ", SPACE)]
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    specials = [t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def _write_gguf(path, arch, tokens, types, scores, *, prefix, template=None, eot=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(prefix)
    if eot is not None:
        w.add_eot_token_id(eot)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def spm_reference(text: str, tokens, types, scores, *, prefix: bool) -> list[int]:
    """SentencePiece / llama.cpp BPE on one stretch of text: merge the best-scoring adjacent pair until none."""
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    symbols = list(((" " if prefix and text else "") + text).replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            pair = symbols[i] + symbols[i + 1]
            if pair in normal and (best is None or scores[ids[pair]] > best[0]):
                best = (scores[ids[pair]], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for s in symbols:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


@pytest.fixture(scope="module")
def llama_vocab():
    return _shuffled(*_vocab(_pieces(), control=["[INST]", "[/INST]"], extra=[("<tool>", USER_DEFINED)]))


@pytest.fixture(scope="module")
def llama_pair(llama_vocab, tmp_path_factory):
    path = _write_gguf(tmp_path_factory.mktemp("spm") / "llama.gguf", "llama", *llama_vocab, prefix=True)
    return load_tokenizer(path), _source(*llama_vocab, prefix=True)


def test_vocabulary_needs_byte_fallback(llama_vocab):
    tokens = set(llama_vocab[0])
    assert "🎉" not in tokens and "日" not in tokens  # so those texts exercise the <0xXX> pieces
    assert any(t.startswith(SPACE) and len(t) > 3 for t in tokens)


def test_llama_gguf_ids_match_source_and_reference(llama_pair, llama_vocab):
    ours, source = llama_pair
    assert ours.vocab_size == len(llama_vocab[0])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text, add_special_tokens=False).ids, repr(text)
        assert ids == spm_reference(text, *llama_vocab, prefix=True), repr(text)
        assert ours.decode(ids) == source.decode(ids) == text, repr(text)
    assert any(i < 259 for i in ours.encode("🎉"))  # byte pieces, not <unk>


def test_llama_gguf_special_tokens_in_text(llama_pair):
    ours, source = llama_pair
    for text in WITH_SPECIALS:
        ids = ours.encode(text)
        assert ids == source.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == source.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == source.decode(ids, skip_special_tokens=True)
    inst = ours.tokenizer.token_to_id("[INST]")
    assert ours.encode("[INST]")[0] == inst and ours.encode("<tool>") == [ours.tokenizer.token_to_id("<tool>")]
    # Text after a special token gets its own space prefix, as SentencePiece and llama.cpp give it.
    assert ours.encode("[INST]hi")[1:] == ours.encode("hi")


def test_llama_gguf_bos_eos_and_no_double_bos(llama_pair):
    ours, _ = llama_pair
    assert (ours.bos_token, ours.eos_token, ours.bos_token_id) == ("<s>", "</s>", 1)
    assert ours.add_bos and not ours.add_eos and ours.eos_token_ids == (2,)
    assert ours.encode("hi", add_special_tokens=True) == [1, *ours.encode("hi")]
    # A prompt whose template wrote <s> keeps one BOS.
    assert ours.encode("<s>[INST] hi", add_special_tokens=True).count(1) == 1
    assert "<s>" in ours.special_tokens and "<tool>" not in ours.special_tokens


def test_llama_gguf_matches_transformers_sentencepiece_conversion(llama_pair, tmp_path, llama_vocab):
    """transformers' own GGUF reader, for the layout it builds for phi3 (the same prefix-space rule as ours)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    path = _write_gguf(tmp_path / "phi3.gguf", "phi3", *llama_vocab, prefix=True)
    arch, tok_dict, _ = mapping.get_gguf_tokenizer(str(path))
    theirs, _ = mapping.convert_gguf_tokenizer(arch, tok_dict)
    ours = load_tokenizer(path)
    # Whitespace right after a special token differs: transformers' reader leaves out phi3's rstrip.
    for text in TEXTS + ["[INST]hi[/INST]Four.</s>", "a<tool>b", "<s>hi"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, repr(text)


def test_phi3_chat_tokens_swallow_the_whitespace_after_them(tmp_path):
    """As phi-3's tokenizer.json (rstrip on its chat tokens) and llama.cpp's phi3 vocabulary do."""
    control = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tokens, types, scores = _vocab(_pieces(), control=control)
    source = _source(tokens, types, scores, prefix=True)
    source.add_special_tokens([AddedToken(t, normalized=False, special=True, rstrip=True) for t in control[1:]])
    ours = load_tokenizer(_write_gguf(tmp_path / "phi3.gguf", "phi3", tokens, types, scores, prefix=True))
    prompt = "<|user|>\nHello there<|end|>\n<|assistant|>\n"
    ids = ours.encode(prompt)
    assert ids == source.encode(prompt, add_special_tokens=False).ids
    assert ids == [
        tokens.index("<|user|>"),
        *ours.encode("Hello there"),
        tokens.index("<|end|>"),
        tokens.index("<|assistant|>"),
    ]
    # <|endoftext|> (and <s>, <unk>) keep what follows them.
    assert ours.encode("<|endoftext|> x")[1:] == ours.encode(" x")


def test_constant_scores_rank_by_position(tmp_path):
    """llama.cpp's converter scores every piece -1000 when a model has only tokenizer.json: file order decides."""
    tokens, types, scores = _vocab(_pieces(), control=["[INST]", "[/INST]"])
    source = _source(tokens, types, scores, prefix=True)
    flat = [-1000.0 if ty == NORMAL else 0.0 for ty in types]
    ours = load_tokenizer(_write_gguf(tmp_path / "hf_only.gguf", "llama", tokens, types, flat, prefix=True))
    for text in TEXTS + WITH_SPECIALS[:2]:
        assert ours.encode(text) == source.encode(text, add_special_tokens=False).ids, repr(text)


def test_incremental_detokenizer_on_sentencepiece(llama_pair):
    ours, source = llama_pair
    prompt = ours.encode("<s>[INST] hi [/INST]")
    for text in ["Hello world, 🎉 done", " two  spaces\nand 日本", "naïve 👩‍👩‍👧 end"]:
        ids = ours.encode(text)
        for context in ((), prompt):
            detok = IncrementalDetokenizer(ours, prompt_ids=context)
            pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
            assert all("\ufffd" not in p for p in pieces)
            # What the ids add to the text before them: alone, the first ▁ is the prefix space and goes;
            # after a prompt it is a real space (a completion continues its prompt's text).
            before = source.decode(list(context))
            whole = source.decode([*context, *ids])
            assert whole.startswith(before) and "".join(pieces) == whole[len(before) :], (text, context)


def test_gemma_gguf_no_prefix_space_and_file_order(tmp_path):
    pieces = _pieces(360)
    # Gemma's file spells runs of spaces with real spaces, and its scores say nothing about merge order.
    tokens, types, scores = _vocab(pieces, control=["<start_of_turn>", "<end_of_turn>"], extra=[])
    runs = [SPACE * 2, SPACE * 4]
    at = 261  # right after the bytes: merged before every other piece
    tokens[at:at] = runs
    types[at:at] = [NORMAL, NORMAL]
    scores = [0.0 if ty != NORMAL else -float(i) for i, ty in enumerate(types)]
    source = _source(tokens, types, scores, prefix=False)
    in_file = [" " * len(t) if t in runs else t for t in tokens]
    file_types = [USER_DEFINED if t in runs else ty for t, ty in zip(tokens, types)]
    template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    )
    path = _write_gguf(
        tmp_path / "gemma.gguf",
        "gemma3",
        in_file,
        file_types,
        [0.0] * len(tokens),
        prefix=False,
        template=template,
        eot=4,
    )
    ours = load_tokenizer(path)
    for text in TEXTS + ["<start_of_turn>user\n    indented  code<end_of_turn>\n"]:
        ids = ours.encode(text)
        assert ids == source.encode(text, add_special_tokens=False).ids, repr(text)
        if "<" not in text:
            assert ids == spm_reference(text, tokens, types, scores, prefix=False), repr(text)
            assert ours.decode(ids) == text
    assert ours.encode("a    b") == [tokens.index("a"), tokens.index(SPACE * 4), tokens.index("b")]
    ids = ours.encode(" lead, 🎉 and  runs")  # no prefix space to strip: the stream keeps the leading one
    detok = IncrementalDetokenizer(ours)
    assert "".join([detok.feed([i]) for i in ids] + [detok.flush()]) == " lead, 🎉 and  runs"
    assert ours.tokenizer.token_to_id("<end_of_turn>") in ours.eos_token_ids


def test_unknown_sentencepiece_layout_is_refused(tmp_path, llama_vocab):
    tokens, types, _ = llama_vocab
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        load_tokenizer(tmp_path / "x.gguf")
