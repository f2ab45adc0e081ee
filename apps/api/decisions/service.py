"""POST /v1/decisions as engine requests: one prefill-only decide request per question.

``decisions_prepare`` (off the event loop) validates the body, writes each
question's prompt (``prompt``) and tokenizes it as the shared input prefix
plus the question's own suffix, so every question's tokens begin with the
very same ids and the engine's prefix retention lets each later question
claim the blocks the first one computed. ``decisions_render`` turns the
engine's answers into the Decision object.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.conf import settings

from apps.api.chat.service import chat_render
from apps.api.decide import ANSWER_LEAD
from apps.api.decisions.answers import answer, usage_of
from apps.api.decisions.prompt import QuestionPrompt, input_head, input_text, question_prompt
from apps.api.decisions.schema import decisions_parse
from apps.core.errors import IgnisError
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest


@dataclass
class PreparedDecisions:
    id: str
    served: ServedModel
    questions: list[QuestionPrompt]
    adds: list[AddRequest]  # one per question, in question order; reply_channel set by the consumer
    num_prefix_tokens: int  # the input's tokens every question shares (0: the template mixed them)


def remap(err: IgnisError) -> IgnisError:
    """The engine's and the chat renderer's param names as this API's."""
    err.param = {"messages": "input"}.get(err.param, err.param)
    return err


def _context_check(num_tokens: int, num_prefix: int, index: int) -> None:
    limit = settings.IGNIS["model.max_context"]
    if num_tokens > limit:
        raise IgnisError(
            f"Question {index}'s prompt is {num_tokens} tokens ({num_prefix} of them the input); "
            f"the context holds {limit}.",
            param="input" if num_prefix >= limit else f"questions[{index}]",
            code="context_length_exceeded",
        )


def decisions_prepare(body: dict) -> PreparedDecisions:
    """Validate, write and tokenize every question's prompt (raises IgnisError naming the param)."""
    req = decisions_parse(body)
    served, suffix_class = model_name_resolve(req.get("model"))
    tok = served.tokenizer
    system, transcript = input_text(req["input"])
    head = input_head(transcript)
    questions = [question_prompt(tok, q, i) for i, q in enumerate(req["questions"])]
    decision_id = f"decision-{uuid.uuid4().hex[:24]}"
    prefix: str | None = None
    prefix_ids: list[int] = []
    adds = []
    for i, q in enumerate(questions):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": head + q.tail}
        ]
        try:
            full = chat_render(served, messages) + ANSWER_LEAD
        except IgnisError as err:
            raise remap(err) from None
        at = full.find(head)
        cut = at + len(head) if at >= 0 else -1
        if cut > 0 and prefix is None:
            prefix, prefix_ids = full[:cut], tok.encode(full[:cut])
        if cut > 0 and full[:cut] == prefix:
            # Tokenized apart so that every question's ids begin with exactly the input's ids.
            ids = prefix_ids + tok.encode(full[cut:])
        else:  # a template that rewrote the content: correct, only without the shared prefix
            ids = tok.encode(full)
        _context_check(len(ids), len(prefix_ids), i)
        adds.append(
            AddRequest(
                request_id=f"{decision_id}-{i}",
                reply_channel="",
                prompt_token_ids=ids,
                max_tokens=0,
                stop_token_ids=list(tok.eos_token_ids),
                request_class=suffix_class or "agent",
                model=served.served_id,
                decide=True,
                decide_token_ids=q.token_ids,
            )
        )
    return PreparedDecisions(
        id=decision_id, served=served, questions=questions, adds=adds, num_prefix_tokens=len(prefix_ids)
    )


@dataclass
class QuestionResult:
    """What the engine answered for one question's request."""

    logprobs: dict[int, float | None]
    prompt_tokens: int
    cached_tokens: int


def decisions_render(prep: PreparedDecisions, results: list[QuestionResult]) -> dict:
    """The Decision object (openai.types.decision.Decision): answers in question order."""
    return {
        "id": prep.id,
        "object": "decision",
        "model": prep.served.served_id,
        "answers": [answer(q, r.logprobs) for q, r in zip(prep.questions, results)],
        "usage": usage_of([r.prompt_tokens for r in results], [r.cached_tokens for r in results]),
    }
