"""Tokenizers for both artifact formats, the tokens that stop a turn, and incremental detokenization.

A Hugging Face directory carries ``tokenizer.json`` (used as is) plus
``tokenizer_config.json`` / ``chat_template.jinja`` / ``generation_config.json``.
A GGUF file carries only metadata (``tokenizer.ggml.*``), from which
:mod:`engine.tokenizer_gguf` rebuilds the tokenizer (byte-level BPE or
SentencePiece), with the chat template and special token ids beside it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.tokenizer_gguf import GGUFVocab, build_gguf_tokenizer

# Tokens that end a turn in common chat templates; they stop generation when the template uses them.
END_OF_TURN = (
    "<|im_end|>",  # ChatML: qwen2/3, smollm, phi4
    "<|eot_id|>",  # llama 3
    "<|eom_id|>",
    "<|end|>",  # phi3 (not gpt-oss: see HARMONY_MESSAGE_END)
    "<end_of_turn>",  # gemma
    "<|end_of_text|>",
    "<|return|>",  # gpt-oss (harmony): the final answer is done
    "<|call|>",  # gpt-oss: a tool call is done, the caller runs it
)
# In OpenAI's harmony format ``<|end|>`` closes one message (e.g. the analysis channel) and the
# assistant goes on with the next; the turn ends at ``<|return|>`` or ``<|call|>``. So a vocabulary
# with those never stops at ``<|end|>`` (llama.cpp drops it from its end-of-generation set too).
HARMONY_MESSAGE_END, HARMONY_TURN_ENDS = "<|end|>", ("<|return|>", "<|call|>")


@dataclass
class TokenizerBundle:
    """A tokenizer plus what the chat path needs around it.

    ``encode`` never lets ``tokenizer.json``'s post-processor add anything:
    with ``add_special_tokens`` it adds BOS (``add_bos``, unless the text
    already starts with it, as a chat template writing ``<s>`` itself does)
    and EOS (``add_eos``) on its own terms, the same for both formats.
    ``eos_token_ids`` are every id that ends a turn (EOS, the file's other
    end ids, the end-of-turn tokens the template uses); ``chat_templates``
    holds a directory's named templates when it has several.
    """

    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    add_bos: bool = False
    special_tokens: tuple[str, ...] = field(default_factory=tuple)
    pad_token: str | None = None
    add_eos: bool = False
    eos_token_id: int | None = None
    chat_templates: dict[str, str] = field(default_factory=dict)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            if not ids or ids[-1] != self.eos_token_id:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def template_for(self, *, tools: bool) -> str | None:
        """The chat template to render with: a ``tool_use`` named template when there are tools (as transformers picks)."""
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_template

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
    named: dict[str, str] = {}
    if isinstance(template, list):  # named templates: "default" (else the first) unless a caller picks another
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    extra_eos: list[int] = []
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        e = json.loads(gen_path.read_text()).get("eos_token_id")
        extra_eos = list(e) if isinstance(e, list) else ([e] if e is not None else [])
    # Without a flag, tokenizer.json's post-processor tells whether BOS / EOS are added (llama's adds BOS).
    probe = tok.encode("a", add_special_tokens=True).ids
    add_bos = bool(cfg.get("add_bos_token", bos_id is not None and probe[:1] == [bos_id]))
    eos_id = tok.token_to_id(eos) if eos else None
    add_eos = bool(cfg.get("add_eos_token", eos_id is not None and probe[-1:] == [eos_id]))
    pad = _token_str(cfg.get("pad_token"))
    return _bundle(tok, bos, eos, bos_id, extra_eos, template, add_bos, pad, add_eos, named)


# --- GGUF metadata ------------------------------------------------------------------------


def _from_gguf(path: Path) -> TokenizerBundle:
    import gguf

    fields = gguf.GGUFReader(str(path)).fields

    def get(key, default=None):
        f = fields.get(key)
        return f.contents() if f is not None else default

    kind = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path.name}: tokenizer.ggml.tokens is missing (the file carries no vocabulary)")
    vocab = GGUFVocab(
        model=kind,
        tokens=tokens,
        types=get("tokenizer.ggml.token_type") or [1] * len(tokens),
        scores=get("tokenizer.ggml.scores"),
        merges=get("tokenizer.ggml.merges"),
        pre=get("tokenizer.ggml.pre"),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
        architecture=get("general.architecture", ""),
        unk_id=get("tokenizer.ggml.unknown_token_id"),
    )
    try:
        tok = build_gguf_tokenizer(vocab)
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from None

    def token_at(key):
        i = get(f"tokenizer.ggml.{key}")
        return (tokens[i], int(i)) if i is not None and 0 <= i < len(tokens) else (None, None)

    bos, bos_id = token_at("bos_token_id")
    eos, eos_id = token_at("eos_token_id")
    pad, _ = token_at("padding_token_id")
    # End-of-turn / end-of-message ids llama.cpp's converter records beside EOS.
    stops = [i for _, i in (token_at("eos_token_id"), token_at("eot_token_id"), token_at("eom_token_id"))]
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool(get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
    template = get("tokenizer.chat_template")
    return _bundle(tok, bos, eos, bos_id, [i for i in stops if i is not None], template, add_bos, pad, add_eos)


def _bundle(tok, bos, eos, bos_id, extra_eos, template, add_bos, pad, add_eos=False, named=None) -> TokenizerBundle:
    specials = tuple(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
    eos_id = tok.token_to_id(eos) if eos else None
    return TokenizerBundle(
        tokenizer=tok,
        bos_token=bos,
        eos_token=eos,
        bos_token_id=bos_id,
        eos_token_ids=stop_token_ids(tok, [eos_id, *extra_eos], " ".join([template or "", *(named or {}).values()])),
        chat_template=template,
        add_bos=add_bos,
        special_tokens=specials,
        pad_token=pad,
        add_eos=add_eos,
        eos_token_id=eos_id,
        chat_templates=dict(named or {}),
    )


def stop_token_ids(tok: Tokenizer, eos_ids: Sequence[int | None], template: str) -> tuple[int, ...]:
    """The ids that end a turn: the artifact's EOS ids, then each :data:`END_OF_TURN` token the template uses.

    Harmony (gpt-oss: a vocabulary with ``<|return|>`` and ``<|call|>``, or a template with ``<|channel|>``)
    always stops at those two and never at ``<|end|>``, even where the file names it EOS: there it only
    closes a message (the analysis channel) and the assistant's next message follows.
    """
    ids = [*eos_ids, *(tok.token_to_id(t) for t in END_OF_TURN if t in template)]
    if "<|channel|>" in template or all(tok.token_to_id(t) is not None for t in HARMONY_TURN_ENDS):
        # Harmony templates write past turns with <|end|>, so <|return|> may not appear in the text.
        ids = [*ids, *(tok.token_to_id(t) for t in HARMONY_TURN_ENDS)]
        ids = [i for i in ids if i != tok.token_to_id(HARMONY_MESSAGE_END)]
    stops: list[int] = []
    for i in ids:
        if i is not None and int(i) not in stops:
            stops.append(int(i))
    return tuple(stops)


# --- incremental detokenization -----------------------------------------------------------


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas, never splitting a UTF-8 character.

    ``tokenizers``' own ``DecodeStream`` does the work (in Rust, one call a round): it
    decodes a short window of ids before and after the last emitted point and yields
    only the difference, so tokenizers whose decoding depends on neighbours (leading
    spaces, byte-level pieces of one character) come out right, and holds back text
    that ends in an incomplete character until more ids arrive. ``flush`` says what is
    still held at the end of a stream (DecodeStream has no such call).
    """

    CONTEXT = 6  # ids of left context: a few prompt tokens, so the first output token decodes as mid-text

    def __init__(self, bundle: TokenizerBundle, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = bundle.tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(t) for t in prompt_ids[-self.CONTEXT :]]  # context, then the held ids
        self._held = 0
        self._stream = DecodeStream(ids=self._ids, skip_special_tokens=skip_special_tokens)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append one round's ids; return the text that became final."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return ""
        delta = self._stream.step(self._tokenizer, ids)
        self._ids.extend(ids)
        if not delta:
            self._held += len(ids)
            return ""
        self._held = 0
        del self._ids[: -self.CONTEXT]
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (incomplete bytes included)."""
        if not self._held:
            return ""
        context = self._ids[: len(self._ids) - self._held][-(self.CONTEXT - 1) :]
        prefix = self._tokenizer.decode(context, skip_special_tokens=self._skip)
        full = self._tokenizer.decode(
            context + self._ids[len(self._ids) - self._held :], skip_special_tokens=self._skip
        )
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        # Whatever follows starts afresh, with no left context (the held ids may end mid-character).
        self._held, self._ids = 0, []
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        if delta:
            self._pieces.append(delta)
        return delta
