"""Per-request sampling parameters.

A request's tokens depend only on its own parameters, its seed and its own
token history, never on which lanes shared its round: randomness is drawn from
a counter-based generator keyed by ``(seed, position)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS). Dividing logits by a
# smaller one overflows float32 (1e-40 is a subnormal, 1e-50 rounds to 0) and the nucleus
# of what is left is empty or NaN; at 1e-5 a logit gap of 1e-3 is already a factor e^100,
# so the draw is the argmax anyway. engine/cu/sample.cu gets the same floor as a define.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below MIN_TEMPERATURE (0 included) means greedy
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
        # ``not >=``: a NaN temperature is greedy too, never a division.
        return not self.temperature >= MIN_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "logit_bias" in kw:  # lists over the channel layer; pairs, so it stays hashable
            kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"])
        return cls(**kw)
