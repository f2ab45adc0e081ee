"""From engine tokens to API text: incremental detokenizing and stop strings.

``TextStream`` is fed the token ids each engine round commits and gives back
the text that is safe to show: never half a UTF-8 character, never the start
of what may turn out to be a stop string. Its cost per token does not grow with
the text: the ids go through ``tokenizers``' DecodeStream (engine.tokenizer's
IncrementalDetokenizer), and only the held-back tail is searched for stop strings.
"""

from __future__ import annotations

import json
import time


class TextStream:
    def __init__(self, bundle, stop: list[str], prompt_ids: list[int] = (), *, skip_special_tokens: bool = True):
        from engine.tokenizer import IncrementalDetokenizer

        # skip_special_tokens False: the output splitter reads special tokens (harmony's markers).
        self._detok = IncrementalDetokenizer(bundle, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._held = ""  # text withheld because it could begin a stop string
        self._pieces: list[str] = []  # everything emitted so far (``text``)
        self.stopped = False  # a stop string matched: the caller aborts the sequence

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def feed(self, token_ids: list[int]) -> str:
        """New visible text for these tokens ('' while holding back)."""
        if self.stopped:
            return ""
        new = self._detok.feed(token_ids)
        if not self._stop:
            return self._emit(new)
        pending = self._held + new
        cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return self._emit(pending[:cut])
        keep = self._partial_stop_len(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep])

    def flush(self) -> str:
        """At the end of generation the held-back text is no stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else self._emit(held + self._detok.flush())

    def _partial_stop_len(self, text: str) -> int:
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class ChatChunks:
    """One chat completion stream's SSE chunks, rendered cheaply: what every chunk repeats (id,
    object, created, model, fingerprint) is serialized once, and each chunk serializes only its
    delta (and logprobs). The bytes are exactly ``sse(chat_chunk(...))``'s."""

    def __init__(self, request_id: str, model: str, created: int) -> None:
        head = _dumps(chat_chunk(request_id, model, created, {}, choices=False))
        self._head = "data: " + head[: -len("[]}")] + '[{"index":'  # the head ends in "choices":[]}

    def render(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        lp = "null" if logprobs is None else _dumps(logprobs)
        reason = "null" if finish_reason is None else _dumps(finish_reason)
        return f'{self._head}{index},"delta":{_dumps(delta)},"logprobs":{lp},"finish_reason":{reason}}}]}}\n\n'.encode()


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else _dumps(data)
    return f"data: {payload}\n\n".encode()


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict,
    finish_reason: str | None = None,
    usage: dict | None = None,
    choices: bool = True,
) -> dict:
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "ignis",
        "choices": [],
    }
    if choices:
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def usage_block(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def now() -> int:
    return int(time.time())
