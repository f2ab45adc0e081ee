"""Turning an API request into an engine request: template, tokens, limits."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.conf import settings

from apps.api.errors import IgnisError, InvalidRequest
from apps.api.validation import ChatRequest, parse_chat_request
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest


@dataclass
class PreparedChat:
    request: ChatRequest
    served: ServedModel
    add: AddRequest  # reply_channel is filled in by the consumer


def chat_render(served: ServedModel, messages: list[dict], template_kwargs: dict | None = None) -> str:
    from engine.chat_template import ChatTemplateError, render_chat

    tok = served.tokenizer
    try:
        return render_chat(tok.chat_template, messages, add_generation_prompt=True, bos_token=tok.bos_token,
                           eos_token=tok.eos_token, **(template_kwargs or {}))
    except ChatTemplateError as exc:
        raise InvalidRequest(f"The chat template refused these messages: {exc}", param="messages") from None


def generation_cap(prompt_len: int, requested: int | None) -> int:
    """max_tokens for the engine: the request's own, else the default, within the context."""
    max_context = settings.IGNIS["model.max_context"]
    if prompt_len >= max_context:
        raise IgnisError(f"This prompt is {prompt_len} tokens; the context holds {max_context}.",
                         param="messages", code="context_length_exceeded")
    room = max_context - prompt_len
    if requested is None:
        return min(settings.IGNIS["model.default_max_tokens"], room)
    if requested > room:
        raise IgnisError(f"max_tokens is {requested} but only {room} tokens of the {max_context}-token context "
                         f"remain after the {prompt_len}-token prompt.", param="max_tokens",
                         code="context_length_exceeded")
    return requested


def chat_prepare(body: dict) -> PreparedChat:
    """Validate, render and tokenize a chat completion request (runs off the event loop)."""
    req = parse_chat_request(body)
    served, suffix_class = model_name_resolve(req.model)
    prompt = chat_render(served, req.messages, req.template_kwargs)
    tok = served.tokenizer
    prompt_ids = tok.encode(prompt)
    add = AddRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        reply_channel="",
        prompt_token_ids=prompt_ids,
        max_tokens=generation_cap(len(prompt_ids), req.max_tokens),
        sampling=req.sampling,
        stop_token_ids=list(tok.eos_token_ids),
        request_class=req.request_class or suffix_class or "interactive",
        model=served.served_id,
    )
    return PreparedChat(request=req, served=served, add=add)


def tokenize_chat(body: dict) -> dict:
    """POST /v1/tokenize: a chat request's prompt tokens exactly as it would be served, or a plain text."""
    from apps.api.validation import parse_messages

    served, _ = model_name_resolve(body.get("model") if isinstance(body.get("model"), str) else None)
    tok = served.tokenizer
    if "messages" in body:
        ids = tok.encode(chat_render(served, parse_messages(body["messages"]), body.get("chat_template_kwargs")))
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"])
    else:
        raise InvalidRequest("Send 'messages' (a chat) or 'prompt' (a string).", param="messages",
                             code="missing_required_parameter")
    return {"model": served.served_id, "tokens": ids, "count": len(ids),
            "max_model_len": settings.IGNIS["model.max_context"]}
