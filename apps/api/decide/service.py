"""POST /v1/decide: a classification answered from one prefill, no token decoded.

    {"evidence": str, "question": str, "labels": [str, ...], "model"?: str,
     "instructions"?: str, "class"?: "agent" | "interactive"}
    -> {"id": "decision-...", "object": "decision", "created", "model", "label",
        "distribution": [{"label", "probability", "logprob"}, ...],
        "label_mass": float, "usage": {...}}

The evidence, question and labels are rendered as a user turn through the
model's template (``instructions``, when given, as the system message), and
the assistant turn is opened with ``Answer:`` so that the next token is the
answer rather than a preamble. The engine prefills that prompt once (the
prefill lane, no decode lane: it defaults to the agent class) and returns
the logits at its last position.

One position means each label is read through its first token. A label
counts the first tokens of its spellings the model might start an answer
with (as given, lower-case, capitalized, with a leading space) unless
another label claims the same token; the label's probability is the sum of
its tokens' probabilities, renormalised over the labels (``label_mass`` is
how much of the model's next-token probability the labels held before
that). Labels whose given spellings begin with the same token (``"New
York"`` and ``"New Delhi"``) cannot be told apart at one position and are
refused with 400 naming ``labels``.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from apps.api.chat.service import chat_render
from apps.api.schemas import validated
from apps.api.schemas.decide import MAX_LABEL_LEN, MAX_LABELS, DecideBody  # noqa: F401 - their old home
from apps.api.usage import usage_block
from apps.core.errors import InvalidRequest
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest

ANSWER_LEAD = "Answer:"


@dataclass
class PreparedDecision:
    served: ServedModel
    add: AddRequest
    labels: list[str]
    label_tokens: list[list[int]]  # per label, the first tokens that count for it


def label_first_tokens(tokenizer, labels: list[str]) -> list[list[int]]:
    """Per label, the first tokens that stand for it; 400 when two labels share their own first token."""

    def first(text: str) -> int | None:
        ids = tokenizer.encode(text)
        return ids[0] if ids else None

    primary = [first(label) for label in labels]
    for i, tok in enumerate(primary):
        if tok is None:
            raise InvalidRequest("This label encodes to no token.", param=f"labels[{i}]")
        if primary.index(tok) != i:
            j = primary.index(tok)
            raise InvalidRequest(
                f"Labels {labels[j]!r} and {labels[i]!r} begin with the same token, so one position cannot tell "
                "them apart; reword one so their first words differ.",
                param="labels",
                code="ambiguous_labels",
            )
    spellings = []
    for label in labels:
        forms = {label, label.lower(), label.capitalize(), label.upper()}
        forms |= {" " + f for f in forms}
        spellings.append({t for f in forms if (t := first(f)) is not None})
    owners: dict[int, int] = {}
    for i, toks in enumerate(spellings):
        for t in toks:
            owners[t] = -1 if t in owners and owners[t] != i else i
    taken = set(primary)
    return [
        sorted({primary[i]} | {t for t in toks if owners[t] == i and t not in taken - {primary[i]}})
        for i, toks in enumerate(spellings)
    ]


def decide_prepare(body: dict) -> PreparedDecision:
    """Validate, render and tokenize a decision request (runs off the event loop)."""
    data = validated(DecideBody, body)
    evidence, question, labels = data.get("evidence") or "", data["question"], data["labels"]
    instructions, model, request_class = data.get("instructions"), data.get("model"), data.get("class")
    served, suffix_class = model_name_resolve(model)
    tok = served.tokenizer
    label_tokens = label_first_tokens(tok, labels)
    user = (f"Evidence: {evidence}\n" if evidence else "") + (
        f"Question: {question}\nLabels: {', '.join(labels)}\nAnswer with the correct label only."
    )
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
        {"role": "user", "content": user}
    ]
    # The assistant turn opens with ANSWER_LEAD so the next token is the answer itself, not a
    # preamble ("The answer is ..."): small models put far more mass on the labels this way.
    prompt = chat_render(served, messages) + ANSWER_LEAD
    prompt_ids = tok.encode(prompt)
    add = AddRequest(
        request_id=f"decision-{uuid.uuid4().hex[:24]}",
        reply_channel="",
        prompt_token_ids=prompt_ids,
        max_tokens=0,
        stop_token_ids=list(tok.eos_token_ids),
        request_class=request_class or suffix_class or "agent",
        model=served.served_id,
        decide=True,
        # Only the labels' first tokens come back (their log-softmax over the whole row), not the
        # whole vocabulary's logits.
        decide_token_ids=sorted({t for toks in label_tokens for t in toks}),
    )
    return PreparedDecision(served=served, add=add, labels=labels, label_tokens=label_tokens)


def decision_render(
    prep: PreparedDecision,
    logits: list[float] | None,
    prompt_tokens: int,
    cached_tokens: int,
    logprobs: dict[int, float | None] | None = None,
) -> dict:
    """The label distribution from the last position: the engine's log-softmax of the labels' tokens
    (``logprobs``, AddRequest.decide_token_ids), or the whole row's ``logits`` (softmax over the
    whole vocabulary first)."""
    if logprobs is None:
        top = max(logits)
        log_z = top + math.log(sum(math.exp(x - top) for x in logits))
        logprobs = {t: logits[t] - log_z for toks in prep.label_tokens for t in toks if t < len(logits)}
    mass = [sum(math.exp(logprobs[t]) for t in toks if logprobs.get(t) is not None) for toks in prep.label_tokens]
    total = sum(mass)
    probs = [m / total for m in mass] if total > 0 else [1.0 / len(mass)] * len(mass)
    best = max(range(len(probs)), key=probs.__getitem__)
    return {
        "id": prep.add.request_id,
        "object": "decision",
        "created": int(time.time()),
        "model": prep.served.served_id,
        "label": prep.labels[best],
        "distribution": [
            {"label": label, "probability": p, "logprob": math.log(p) if p > 0 else None}
            for label, p in zip(prep.labels, probs)
        ],
        "label_mass": total,
        "usage": usage_block(prompt_tokens, 0, cached_tokens, reasoning_tokens=None),
    }
