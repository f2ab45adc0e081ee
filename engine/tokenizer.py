"""Tokenizers for both artifact formats, and incremental detokenization.

A Hugging Face directory carries ``tokenizer.json`` (used as is) plus
``tokenizer_config.json`` / ``chat_template.jinja``. A GGUF file carries only
metadata (``tokenizer.ggml.*``), from which we rebuild a byte-level BPE
``tokenizers.Tokenizer`` the same way transformers does for ``gguf_file=``:
the file's vocabulary and merges, the split regex its ``pre`` name implies
(GPT-2's for names transformers has no table entry for, e.g. ``smollm``), and
control tokens as special added tokens so they are never cut into pieces.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF ``tokenizer.ggml.pre`` names whose split differs from GPT-2's (as transformers maps them).
PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}
# Tokens that end a turn in common chat templates; they stop generation when the template uses them.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")
# Harmony (gpt-oss): a turn ends with <|return|> or a tool call's <|call|>; its <|end|> only closes one
# message (the reasoning), after which the answer follows, so it must not stop generation.
HARMONY_END_OF_TURN = ("<|return|>", "<|call|>")
_CONTROL, _USER_DEFINED = 3, 4


@dataclass
class TokenizerBundle:
    """A tokenizer plus what the chat path needs around it."""

    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    add_bos: bool = False
    special_tokens: tuple[str, ...] = field(default_factory=tuple)
    pad_token: str | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


_shared_lock = threading.Lock()
_shared: dict[str, TokenizerBundle] = {}


def shared_tokenizer(path: str | Path) -> TokenizerBundle:
    """The process's one TokenizerBundle for an artifact (loaded once, by whoever asks first):
    the Django side's ServedModel and the engine's grammar factory share it when embedded."""
    key = str(Path(path).resolve())
    with _shared_lock:
        bundle = _shared.get(key)
        if bundle is None:
            bundle = _shared[key] = load_tokenizer(key)
        return bundle


def load_tokenizer(path: str | Path) -> TokenizerBundle:
    """From a ``.gguf`` file's metadata or a Hugging Face directory."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _from_gguf(p)
    return _from_directory(p)


# --- Hugging Face directories -------------------------------------------------------------


def _token_str(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _from_directory(root: Path) -> TokenizerBundle:
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    cfg_path = root / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = None
    if (root / "chat_template.jinja").exists():
        template = (root / "chat_template.jinja").read_text()
    elif (root / "chat_template.json").exists():
        template = json.loads((root / "chat_template.json").read_text()).get("chat_template")
    else:
        template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    extra_eos: list[int] = []
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        e = json.loads(gen_path.read_text()).get("eos_token_id")
        extra_eos = list(e) if isinstance(e, list) else ([e] if e is not None else [])
    # tokenizer.json's post-processor tells whether BOS is added (llama's adds it, qwen2's does not).
    add_bos = bool(cfg.get("add_bos_token", False))
    if bos_id is not None and "add_bos_token" not in cfg:
        add_bos = tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    return _bundle(tok, bos, eos, bos_id, extra_eos, template, add_bos, _token_str(cfg.get("pad_token")))


# --- GGUF metadata ------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
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


def _from_gguf(path: Path) -> TokenizerBundle:
    import gguf

    fields = gguf.GGUFReader(str(path)).fields

    def get(key, default=None):
        f = fields.get(f"tokenizer.{key}")
        return f.contents() if f is not None else default

    kind = get("ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens: list[str] = get("ggml.tokens")
    types: list[int] = get("ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in get("ggml.merges") or []]
    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    # A token outside the byte alphabet is written in plain UTF-8; re-spell it (as transformers does).
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_SPLITS.get(get("ggml.pre"))
    if split is None:
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
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab
        ]
    )

    def token_at(key):
        i = get(key)
        return (tokens[i], int(i)) if i is not None and 0 <= i < len(tokens) else (None, None)

    bos, bos_id = token_at("ggml.bos_token_id")
    eos, eos_id = token_at("ggml.eos_token_id")
    pad, _ = token_at("ggml.padding_token_id")
    extra = [eos_id] if eos_id is not None else []
    return _bundle(tok, bos, eos, bos_id, extra, get("chat_template"), bool(get("ggml.add_bos_token", False)), pad)


def _bundle(tok, bos, eos, bos_id, extra_eos, template, add_bos, pad) -> TokenizerBundle:
    specials = tuple(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
    eos_ids: list[int] = []
    candidates = [tok.token_to_id(eos) if eos else None, *extra_eos]
    if template and "<|channel|>" in template:
        candidates = [i for i in candidates if i != tok.token_to_id("<|end|>")]
        candidates += [tok.token_to_id(t) for t in HARMONY_END_OF_TURN]
    else:
        candidates += [tok.token_to_id(t) for t in END_OF_TURN if template and t in template]
    for i in candidates:
        if i is not None and i not in eos_ids:
            eos_ids.append(int(i))
    return TokenizerBundle(
        tokenizer=tok,
        bos_token=bos,
        eos_token=eos,
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        chat_template=template,
        add_bos=add_bos,
        special_tokens=specials,
        pad_token=pad,
    )


# --- incremental detokenization -----------------------------------------------------------


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas, never splitting a UTF-8 character.

    The prefix-offset / read-offset technique: decode a short window of ids
    before and after the last emitted point and emit only the difference, so
    tokenizers whose decoding depends on neighbours (leading spaces, byte-level
    pieces of one character) come out right. Text ending in U+FFFD means a
    character is still incomplete: it is held back until more ids arrive.
    """

    def __init__(self, bundle: TokenizerBundle, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._decode = lambda ids: bundle.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        # A few prompt tokens as left context, so the first output token decodes as it would mid-text.
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append one round's ids; return the text that became final."""
        self.ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (incomplete bytes included)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
