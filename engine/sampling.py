"""Per-request sampling parameters.

A request's tokens depend only on its own parameters, its seed and its own
token history, never on which lanes shared its round: randomness is drawn from
a counter-based generator keyed by ``(seed, position)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before any mask.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # the stop token ids cannot be drawn before this many output tokens
    ignore_eos: bool = False  # the stop token ids do not end the sequence (admission drops them)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "logit_bias" in kw:  # lists over the channel layer; pairs, so it stays hashable
            kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"])
        return cls(**kw)
