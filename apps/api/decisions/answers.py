"""A question's answer from the engine's log-softmax of its tokens at the answer position.

``logprobs`` maps each token the question named (``QuestionPrompt.token_ids``,
sent as ``AddRequest.decide_token_ids``) to its log-probability over the
whole vocabulary. An option's mass is the sum of its tokens' probabilities;
probabilities are those masses renormalised over the offered options, so
they sum to 1. When the tokens that begin a refusal outweigh all the options
together, the model declined: the answer is a refusal.

* predicate: ``probability`` that the statement is true (P(yes)).
* choice: ``choice`` is the most probable value (the first listed on a tie),
  ``confidence`` its probability.
* score: ``score`` is the probability-weighted level index (0 for the first
  level, n-1 for the last), ``confidence`` the most probable level's
  probability.
"""

from __future__ import annotations

import math

from apps.api.decisions.prompt import QuestionPrompt
from apps.api.usage import usage_object


def _mass(tokens: list[int], logprobs: dict[int, float | None]) -> float:
    return sum(math.exp(lp) for t in tokens if (lp := logprobs.get(t)) is not None)


def option_distribution(q: QuestionPrompt, logprobs: dict[int, float | None]) -> tuple[list[float], bool]:
    """(probabilities over the options, summing to 1; whether the model declined)."""
    mass = [_mass(toks, logprobs) for toks in q.option_tokens]
    total = sum(mass)
    refused = _mass(q.refusal_tokens, logprobs) > total
    if total <= 0 or not math.isfinite(total):
        return [1.0 / len(mass)] * len(mass), refused
    return [m / total for m in mass], refused


def score_of(probs: list[float]) -> float:
    """The probability-weighted level index."""
    return sum(i * p for i, p in enumerate(probs))


def answer(q: QuestionPrompt, logprobs: dict[int, float | None]) -> dict:
    """The answer object (openai.types.decision.Answer) for one question."""
    probs, refused = option_distribution(q, logprobs)
    if refused:
        return {"type": "refusal", "name": q.name}
    best = max(range(len(probs)), key=probs.__getitem__)
    if q.kind == "predicate":
        return {"type": "predicate", "name": q.name, "probability": probs[0]}
    if q.kind == "choice":
        return {
            "type": "choice",
            "name": q.name,
            "choice": q.values[best],
            "confidence": probs[best],
            "probabilities": [{"value": v, "probability": p} for v, p in zip(q.values, probs)],
        }
    return {
        "type": "score",
        "name": q.name,
        "score": score_of(probs),
        "confidence": probs[best],
        "probabilities": [{"label": v, "value": i, "probability": p} for i, (v, p) in enumerate(zip(q.values, probs))],
    }


def usage_of(prompt_tokens: list[int], cached_tokens: list[int]) -> dict:
    """Usage over the request's engine requests (one per question): every prompt counts, and
    the tokens the engine claimed from retained state are cached; the rest it computed and kept."""
    total, cached = sum(prompt_tokens), sum(cached_tokens)
    return usage_object(total, 0, cached, cache_write_tokens=total - cached)
