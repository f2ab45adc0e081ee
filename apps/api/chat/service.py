"""POST /v1/chat/completions, the service: a chat request into engine requests (template, tokens, limits).

The template rendering (``chat_render``), ``generation_cap`` and the engine requests' build
(``_adds``) serve the completions, Responses and decide services too."""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field

from django.conf import settings

from apps.api.output_parsers import DEFAULT, OutputParsers, output_parsers_for
from apps.api.thinking import reasoning_budget, reasoning_watch, thinking_kwargs
from apps.api.validation import ChatRequest, parse_chat_request
from apps.core.errors import IgnisError, InvalidRequest
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest


@dataclass
class PreparedChat:
    request: ChatRequest
    served: ServedModel
    add: AddRequest  # the first choice's; reply_channel is filled in by the consumer
    adds: list[AddRequest] = field(default_factory=list)  # one per choice (n)
    prompt: str = ""
    in_reasoning: bool = False  # the template opened the reasoning in the prompt
    parse_tools: bool = False
    parsers: OutputParsers = DEFAULT  # the model's reasoning and tool tags
    id: str = ""  # the response's id (choices' engine requests add -<i> when n > 1)


def chat_render(
    served: ServedModel, messages: list[dict], template_kwargs: dict | None = None, tools: list[dict] | None = None
) -> str:
    from engine.chat_template import ChatTemplateError, render_chat

    tok = served.tokenizer
    try:
        return render_chat(
            tok.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=True,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            **(template_kwargs or {}),
        )
    except ChatTemplateError as exc:
        raise InvalidRequest(f"The chat template refused these messages: {exc}", param="messages") from None
    except TypeError as exc:  # a chat_template_kwargs key that clashes with the template's own arguments
        raise InvalidRequest(f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None


def generation_cap(prompt_len: int, requested: int | None) -> int:
    """max_tokens for the engine: the request's own, else the default, within the context."""
    max_context = settings.IGNIS["model.max_context"]
    if prompt_len >= max_context:
        raise IgnisError(
            f"This prompt is {prompt_len} tokens; the context holds {max_context}.",
            param="messages",
            code="context_length_exceeded",
        )
    room = max_context - prompt_len
    if requested is None:
        return min(settings.IGNIS["model.default_max_tokens"], room)
    if requested > room:
        raise IgnisError(
            f"max_tokens is {requested} but only {room} tokens of the {max_context}-token context "
            f"remain after the {prompt_len}-token prompt.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def chat_prompt(req: ChatRequest, served: ServedModel) -> tuple[str, list[int]]:
    """The prompt text and tokens exactly as the request would be served (tools, switches and
    each image's placeholder tokens included)."""
    prompt, ids, _, _ = _chat_prompt(req, served)
    return prompt, ids


def _chat_prompt(req: ChatRequest, served: ServedModel) -> tuple[str, list[int], int, list[dict] | None]:
    """The prompt, its tokens, how many of them are its system block (``system_block_len``),
    and its images (AddRequest.images, None without): the template renders the request once;
    the system block alone is rendered once per distinct block (a burst of subagents shares one)."""
    from apps.api.images.prompt import images_attach, prompt_images
    from apps.api.tools import tools_prompt_apply

    tools = req.tools if req.tool_choice != "none" else []
    messages, vision, parts = prompt_images(served, req.messages)
    messages, template_tools = tools_prompt_apply(messages, tools, served.tokenizer.chat_template)
    template = served.tokenizer.chat_template
    reasons = output_parsers_for(served.tokenizer).reasoning.start in (template or "")
    template_kwargs = thinking_kwargs(req.template_kwargs, req.reasoning_effort, template, param="reasoning_effort", reasons=reasons)  # fmt: skip
    prompt = chat_render(served, messages, template_kwargs, template_tools)
    ids, images = images_attach(served.tokenizer.encode(prompt), vision, parts)
    return prompt, ids, system_block_len(served, messages, template_tools, template_kwargs, ids), images


def system_block_len(
    served: ServedModel, messages: list[dict], tools: list[dict] | None, template_kwargs: dict, prompt_ids: list[int]
) -> int:
    """How many leading prompt tokens are its system block: the leading system messages
    rendered alone (tools included), as far as they tokenize the same. The engine keeps
    that span as a shared prefix (a burst of subagents opening with one block); 0 if none."""
    k = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if k == 0:
        return 0
    try:  # key order kept: the template may render dicts in their order
        key = json.dumps([str(served.path), messages[:k], tools, template_kwargs])
    except (TypeError, ValueError):
        return 0
    block = _system_block_ids(key)
    n = 0
    for a, b in zip(block, prompt_ids):
        if a != b:
            break
        n += 1
    return n


@functools.lru_cache(maxsize=256)
def _system_block_ids(key: str) -> tuple[int, ...]:
    """The system block's tokens, by (artifact, leading system messages, tools, kwargs) as JSON."""
    from engine.chat_template import ChatTemplateError, render_chat
    from engine.tokenizer import shared_tokenizer

    path, messages, tools, template_kwargs = json.loads(key)
    tok = shared_tokenizer(path)
    try:
        text = render_chat(
            tok.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=False,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            **template_kwargs,
        )
    except (ChatTemplateError, TypeError):  # a template that wants more than a system block
        return ()
    return tuple(tok.encode(text))


def _sampling_for(sampling: dict, i: int) -> dict:
    """Choice i's sampling: a seeded request's choices get consecutive seeds so they differ, reproducibly."""
    if i == 0 or sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": (sampling["seed"] + i) % (1 << 64)}


def _adds(
    base_id: str,
    prompts: list[list[int]],
    copies: int,
    served: ServedModel,
    *,
    max_tokens: list[int],
    sampling: dict,
    request_class: str,
    grammar: str | None,
    logprobs: bool,
    top: int,
    shared_prefix_len: int = 0,
    prediction_token_ids: list[int] | None = None,
    reasoning: dict | None = None,
    images: list[dict] | None = None,
) -> list[AddRequest]:
    adds = []
    for p, ids in enumerate(prompts):
        for c in range(copies):
            i = p * copies + c
            adds.append(
                AddRequest(
                    request_id=base_id if len(prompts) * copies == 1 else f"{base_id}-{i}",
                    reply_channel="",
                    prompt_token_ids=ids,
                    max_tokens=max_tokens[p],
                    sampling=_sampling_for(sampling, i),
                    stop_token_ids=list(served.tokenizer.eos_token_ids),
                    request_class=request_class,
                    model=served.served_id,
                    want_logprobs=logprobs,
                    num_logprobs=top,
                    grammar=grammar,
                    shared_prefix_len=shared_prefix_len,
                    prediction_token_ids=prediction_token_ids,
                    reasoning=reasoning,
                    images=images,
                )
            )
    return adds


def chat_prepare(body: dict) -> PreparedChat:
    """Validate, render and tokenize a chat completion request (runs off the event loop)."""
    req = parse_chat_request(body)
    served, suffix_class = model_name_resolve(req.model)
    prompt, prompt_ids, system_len, images = _chat_prompt(req, served)
    base = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    parsers = output_parsers_for(served.tokenizer)
    in_reasoning = parsers.reasoning.opened_by(prompt)
    budget = reasoning_budget(req.max_reasoning_tokens, req.reasoning_effort)
    adds = _adds(
        base,
        [prompt_ids],
        req.n,
        served,
        max_tokens=[generation_cap(len(prompt_ids), req.max_tokens)],
        sampling=req.sampling,
        request_class=req.request_class or suffix_class or "interactive",
        grammar=req.grammar,
        logprobs=req.logprobs,
        top=req.top_logprobs,
        shared_prefix_len=system_len,
        prediction_token_ids=served.tokenizer.encode(req.prediction) if req.prediction is not None else None,
        reasoning=reasoning_watch(served.tokenizer, parsers, opened=in_reasoning, budget=budget),
        images=images,
    )
    return PreparedChat(
        request=req,
        served=served,
        add=adds[0],
        adds=adds,
        prompt=prompt,
        in_reasoning=in_reasoning,
        parse_tools=req.tool_choice != "none",
        parsers=parsers,
        id=base,
    )
