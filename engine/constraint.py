"""Constrained decoding: a per-sequence grammar that masks the tokens a row may draw.

A request may carry a grammar (``AddRequest.grammar``): an llguidance grammar
string, built on the API side from a JSON schema, ``json_object`` mode or a
tool-call grammar. The engine turns it into one :class:`GrammarConstraint`
per sequence. Each step the sampler asks it for the allowed tokens of that
row (after penalties, before temperature and truncation) and masks the rest
to -inf; once the scheduler commits the token, the constraint consumes it.
When the grammar is complete only the stop tokens stay allowed, so the
sequence ends as any other would, with ``finish_reason`` stop.

The matcher is only ever touched by one thread at a time: the sampler's mask
on the step thread, ``consume`` on the loop between steps.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np


class ConstraintError(ValueError):
    """The grammar does not compile (bad schema, unsupported keyword)."""


def ll_tokenizer(bundle):
    """An llguidance tokenizer for a :class:`engine.tokenizer.TokenizerBundle` (about 0.3 s; cache it)."""
    import llguidance

    return llguidance.LLTokenizer(
        bundle.tokenizer.to_str(), n_vocab=bundle.vocab_size, eos_token=list(bundle.eos_token_ids) or None
    )


_ll_lock = threading.Lock()
_ll: dict[int, tuple[object, object]] = {}  # id(bundle) -> (bundle, its llguidance tokenizer)


def ll_tokenizer_for(bundle):
    """The process's one llguidance tokenizer for ``bundle`` (grammars here, token bytes for
    logprobs on the Django side): with engine.tokenizer.shared_tokenizer, one per model."""
    with _ll_lock:
        hit = _ll.get(id(bundle))
        if hit is None or hit[0] is not bundle:
            hit = _ll[id(bundle)] = (bundle, ll_tokenizer(bundle))
        return hit[1]


class GrammarConstraint:
    def __init__(self, matcher, vocab_size: int, stop_token_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar accepts next (only the stop tokens once it cannot go on)."""
        mask = np.zeros(self.vocab_size, dtype=bool)
        if not self.matcher.is_error():
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if not mask.any():
            mask[self.stop_token_ids] = True
        return mask

    def mask_logits(self, x: np.ndarray) -> None:
        """In place on one row of logits [vocab]: disallowed tokens become -inf."""
        allowed = self.allowed()
        n = min(x.shape[0], allowed.shape[0])
        x[:n][~allowed[:n]] = -np.inf
        x[n:] = -np.inf

    def consume(self, token_id: int) -> None:
        if not self.matcher.is_error() and not self.matcher.is_stopped():
            self.matcher.consume_token(int(token_id))


class ConstraintFactory:
    """Builds constraints for one loaded artifact; the tokenizer is loaded once, lazily or by ``warm()``."""

    def __init__(self, artifact_path: str | Path):
        self.artifact_path = Path(artifact_path)
        self._lock = threading.Lock()
        self._tok = None
        self._vocab = 0

    def warm_in_background(self) -> None:
        """Load the tokenizer on a thread of its own (seconds for a GGUF), so no request waits for it."""

        def run() -> None:
            try:
                self.warm()
            except Exception:  # the first constrained request reports the problem
                pass

        threading.Thread(target=run, name="ignis-grammar-warm", daemon=True).start()

    def warm(self) -> None:
        with self._lock:
            if self._tok is None:
                from engine.tokenizer import shared_tokenizer

                bundle = shared_tokenizer(self.artifact_path)
                self._tok, self._vocab = ll_tokenizer_for(bundle), bundle.vocab_size

    def build(self, grammar: str, stop_token_ids: list[int], vocab_size: int | None = None) -> GrammarConstraint:
        import llguidance

        self.warm()
        matcher = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(matcher.get_error())
        return GrammarConstraint(matcher, vocab_size or self._vocab, stop_token_ids)
