"""POST /v1/tokenize and /v1/detokenize, the service: tokens exactly as the generating routes count them."""

from __future__ import annotations

from django.conf import settings

from apps.api.chat.service import chat_prompt
from apps.api.validation import parse_chat_request, parse_completion_request
from apps.core.errors import InvalidRequest
from apps.models.services import model_name_resolve, served_model


def tokenize_chat(body: dict) -> dict:
    """POST /v1/tokenize: a chat request's prompt tokens exactly as chat completions would serve them
    (the same validation, template, tools and switches), or a plain prompt as /v1/completions would."""
    if "messages" in body:
        req = parse_chat_request(body)
        served, _ = model_name_resolve(req.model)
        _, ids = chat_prompt(req, served)
    elif "prompt" in body:
        req = parse_completion_request({**body, "max_tokens": 1})
        if len(req.prompts) != 1:
            raise InvalidRequest("Tokenize one prompt at a time.", param="prompt")
        served, _ = model_name_resolve(req.model)
        p = req.prompts[0]
        ids = served.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
    else:
        raise InvalidRequest(
            "Send 'messages' (a chat) or 'prompt' (a string).", param="messages", code="missing_required_parameter"
        )
    return {
        "model": served.served_id,
        "tokens": ids,
        "count": len(ids),
        "max_model_len": settings.IGNIS["model.max_context"],
    }


def detokenize(tokens) -> dict:
    """POST /v1/detokenize: the text of a list of token ids of the served model."""
    tok = served_model().tokenizer
    vocab = tok.tokenizer.get_vocab_size()
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("'tokens' must be an array of integers.", param="tokens", code="invalid_type")
    if any(t < 0 or t >= vocab for t in tokens):
        raise InvalidRequest(f"Token ids must be in [0, {vocab}).", param="tokens")
    return {"text": tok.decode(tokens)}
