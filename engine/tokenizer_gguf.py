"""Rebuilding a model's tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no ``tokenizer.json``, only the vocabulary and a few flags, so
we build the ``tokenizers.Tokenizer`` those describe. Two vocabulary kinds:

* ``gpt2``: byte-level BPE (qwen2/3, llama 3, phi4, gpt-oss, mistral nemo).
  The vocabulary and merges are the file's; the split regex comes from the
  ``tokenizer.ggml.pre`` name (:data:`PRE_SPLITS`, GPT-2's for names with no
  entry, e.g. ``smollm``).
* ``llama``: SentencePiece BPE with byte fallback (llama 2, mistral v0.1-v0.3,
  mixtral, phi3, gemma 1-3). The file has pieces and scores but no merges:
  a pair merges when both halves and their concatenation are normal pieces,
  the merged piece's score ranking it (gemma: its position in the file; equal
  scores: the lower id first, so a file whose scores are all alike -- llama.cpp
  writes -1000 for models it converts from tokenizer.json alone -- ranks by
  position too), as SentencePiece and llama.cpp merge. ``▁`` stands for a space, ``<0xXX>``
  pieces spell bytes no piece covers, and with ``add_space_prefix`` (on unless
  the file says otherwise; gemma's says off) every stretch of text gets a
  leading ``▁`` -- the one at the start and each one following a special
  token, as llama.cpp and SentencePiece do.

In both, control and unknown tokens become special added tokens and
user-defined ones plain added tokens, so text naming them is never cut up
(phi3's also take the whitespace after them, as its own tokenizer does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# As llama 3's, but one digit at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken: a word ends where lower case turns upper (``helloWorld`` -> ``hello`` ``World``); single digits.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k (gpt-4o, gpt-oss): tekken's case split, contractions kept on their word, up to 3 digits.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ``tokenizer.ggml.pre`` names (as llama.cpp's converter writes them) -> the split their merges were learned on;
# a name not here (``default``, ``gpt-2``, ``smollm``, ...) splits as GPT-2 does.
PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4"], _O200K_SPLIT),
}

# llama.cpp's token types (``tokenizer.ggml.token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Architectures whose pieces merge in file order rather than by score (transformers found the same).
_RANK_BY_POSITION = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"
_PHI3_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` fields a tokenizer is built from."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    add_space_prefix: bool = True
    architecture: str = ""
    unk_id: int | None = None  # ``tokenizer.ggml.unknown_token_id``; else the first token typed unknown


def build_gguf_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` a GGUF's vocabulary describes; a ``ValueError`` names what is missing."""
    if vocab.model == "gpt2":
        tok, spelled = _byte_level(vocab)
    elif vocab.model == "llama":
        tok, spelled = _sentencepiece(vocab)
    else:
        raise ValueError(
            f"tokenizer.ggml.model {vocab.model!r} is not supported "
            "('gpt2' byte-level BPE and 'llama' SentencePiece are)"
        )
    _add_special(tok, vocab, spelled)
    return tok


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _byte_level(vocab: GGUFVocab) -> tuple[Tokenizer, list[str | None]]:
    spell = byte_alphabet()
    alphabet = set(spell.values())
    # A token outside the byte alphabet is written in plain UTF-8; re-spell it (as transformers does).
    spelled = [t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")) for t in vocab.tokens]
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges or []]
    ids = {t: i for i, t in enumerate(spelled)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_SPLITS.get(vocab.pre)
    if split is None:  # GPT-2's own split, built into the byte-level pre-tokenizer
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control tokens outside the byte alphabet are llama.cpp mislabels; adding them would grow the vocab.
    usable = [t if set(t) <= alphabet else None for t in vocab.tokens]
    return tok, usable


def _sentencepiece(vocab: GGUFVocab) -> tuple[Tokenizer, list[str | None]]:
    if vocab.scores is None and vocab.architecture not in _RANK_BY_POSITION:
        raise ValueError("tokenizer.ggml.scores is missing: a 'llama' (SentencePiece) vocabulary merges by score")
    tokens, types = list(vocab.tokens), list(vocab.types)
    if vocab.architecture in _RANK_BY_POSITION:
        # Gemma stores its runs of spaces as real spaces; the merges and the normalizer speak of ``▁``,
        # and the respelled runs are pieces like any other, whatever type the file gives them.
        tokens = [SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
        types = [NORMAL if t != orig else ty for t, orig, ty in zip(tokens, vocab.tokens, types)]
        ranks = [-float(i) for i in range(len(tokens))]
    else:
        ranks = [float(s) for s in vocab.scores]
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    unk = next((t for t, ty in zip(tokens, vocab.types) if ty == UNKNOWN), None)
    if vocab.unk_id is not None and 0 <= vocab.unk_id < len(tokens):
        unk = tokens[vocab.unk_id]
    tok = Tokenizer(
        models.BPE(vocab=ids, merges=spm_merges(tokens, types, ranks), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Prepend(SPACE)] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    undo = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        undo.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(undo)
    # A respelled run of spaces stays a vocabulary piece, never an added token (transformers leaves it out too).
    return tok, [t if t == orig else None for t, orig in zip(tokens, vocab.tokens)]


def spm_merges(tokens: Sequence[str], types: Sequence[int], ranks: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging of ``tokens``.

    Every way of cutting a normal piece into two normal pieces is a merge; the
    higher the merged piece's rank, the earlier it applies (ties: lower id
    first, then the shorter left half), which is the order SentencePiece and
    llama.cpp pick the best adjacent pair in.
    """
    mergeable = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (NORMAL, UNUSED) and t}
    found = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                found.append((-ranks[i], i, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special(tok: Tokenizer, vocab: GGUFVocab, spelled: list[str | None]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens.

    Phi-3's own ``tokenizer.json`` strips the whitespace after its chat tokens (``<|user|>\n`` is one
    token), and llama.cpp does the same for a phi3 SentencePiece vocabulary: so do we, sparing
    :data:`_PHI3_NO_RSTRIP`.
    """
    known = tok.get_vocab()
    rstrip = vocab.model == "llama" and vocab.architecture == "phi3"
    special, plain = [], []
    for t, ty in zip(spelled, vocab.types):
        if t is None or t not in known:
            continue
        strip = rstrip and t not in _PHI3_NO_RSTRIP
        if ty in (CONTROL, UNKNOWN):
            special.append(AddedToken(t, normalized=False, special=True, rstrip=strip))
        elif ty == USER_DEFINED:
            plain.append(AddedToken(t, normalized=False, special=False, rstrip=strip))
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
