"""POST /v1/completions, the service: the prompts as given (no template) into engine requests."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from apps.api.chat.service import _adds, generation_cap
from apps.api.validation import CompletionRequest, parse_completion_request
from apps.core.errors import InvalidRequest
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest


@dataclass
class PreparedCompletion:
    request: CompletionRequest
    served: ServedModel
    adds: list[AddRequest]  # one per (prompt, n); empty when nothing is to be generated
    prompt_ids: list[list[int]]  # per choice
    prompt_texts: list[str]  # per choice (for echo)
    id: str = ""


def completion_prepare(body: dict) -> PreparedCompletion:
    """POST /v1/completions: the prompts as given (no template), one engine request per prompt and copy."""
    req = parse_completion_request(body)
    served, suffix_class = model_name_resolve(req.model)
    tok = served.tokenizer
    vocab = tok.vocab_size
    ids_list, texts = [], []
    for i, p in enumerate(req.prompts):
        if isinstance(p, str):
            ids = tok.encode(p, add_special_tokens=True)
            text = p
        else:
            if any(t < 0 or t >= vocab for t in p):
                raise InvalidRequest(f"Token ids must be in [0, {vocab}).", param=f"prompt[{i}]")
            ids, text = list(p), tok.decode(p, skip_special_tokens=False)
        if not ids:
            raise InvalidRequest("The prompt is empty.", param="prompt", code="invalid_prompt")
        ids_list.append(ids)
        texts.append(text)
    base = f"cmpl-{uuid.uuid4().hex[:24]}"
    per_choice_ids = [ids for ids in ids_list for _ in range(req.n)]
    per_choice_texts = [t for t in texts for _ in range(req.n)]
    if req.max_tokens == 0:
        if not req.echo:
            raise InvalidRequest("max_tokens 0 generates nothing; use it with echo.", param="max_tokens")
        return PreparedCompletion(req, served, [], per_choice_ids, per_choice_texts, base)
    caps = [generation_cap(len(ids), req.max_tokens) for ids in ids_list]
    adds = _adds(
        base,
        ids_list,
        req.n,
        served,
        max_tokens=caps,
        sampling=req.sampling,
        request_class=req.request_class or suffix_class or "interactive",
        grammar=req.grammar,
        logprobs=req.logprobs is not None,
        top=req.logprobs or 0,
    )
    if req.echo and req.logprobs is not None:  # the echoed prompt is scored too (engine: numpy backend)
        for add in adds:
            add.prompt_logprobs = req.logprobs
    return PreparedCompletion(req, served, adds, per_choice_ids, per_choice_texts, base)
