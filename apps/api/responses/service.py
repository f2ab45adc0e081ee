"""The Responses API's services: a request body to an engine request, and stored responses.

``response_parse`` validates (naming the param, as ``input[2].content``);
``response_prepare`` (off the event loop) renders the conversation through
the chat template and tokenizes it. A ``previous_response_id`` continues a
stored conversation: its messages come first, so the new prompt begins with
the previous one's tokens and the engine resumes from the state it retained
(``usage.input_tokens_details.cached_tokens``). Instructions are per request
and are not carried over, as in OpenAI's API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from apps.api.chat.service import chat_render, generation_cap
from apps.api.images.prompt import images_attach, prompt_images
from apps.api.output_parsers import output_parsers_for
from apps.api.responses.events import new_id
from apps.api.schemas import given, validated
from apps.api.schemas.responses import INPUT_ROLES, MAX_ITEMS, ResponseBody  # noqa: F401 - their old home
from apps.api.thinking import reasoning_budget, reasoning_watch, thinking_kwargs
from apps.api.tools import (
    Tool,
    _schema,
    json_schema_grammar,
    tool_choice_grammar,
    tool_choice_parse,
    tools_parse,
    tools_prompt_apply,
)
from apps.core.errors import IgnisError, PreviousResponseNotFound
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest


@dataclass
class ResponseRequest:
    messages: list[dict]  # the new input as chat messages
    instructions: str | None = None
    model: str | None = None
    stream: bool = False
    store: bool = True
    generate: bool = True
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    tools: list[Tool] = field(default_factory=list)
    tools_echo: list[dict] = field(default_factory=list)  # as the request gave them
    tool_choice: str | Tool = "none"
    parallel_tool_calls: bool = True
    sampling: dict = field(default_factory=dict)
    request_class: str | None = None
    metadata: dict = field(default_factory=dict)
    deadline: float | None = None  # seconds; None: server.deadline
    text_format: dict = field(default_factory=lambda: {"type": "text"})  # echoed as text.format
    text_grammar: str | None = None  # text.format json_schema / json_object, as chat's response_format
    reasoning_effort: str | None = None  # reasoning.effort, mapped as chat's reasoning_effort
    max_reasoning_tokens: int | None = None  # extension: the thinking budget (else reasoning.effort's)


@dataclass
class PreparedResponse:
    request: ResponseRequest
    served: ServedModel
    add: AddRequest  # reply_channel is filled in by the consumer
    conversation: list[dict]  # previous messages + the new input (no instructions)
    base: dict  # the Response object before any output
    in_reasoning: bool = False  # the prompt opened <think> itself


def _tool_choice_echo(choice: str | Tool) -> Any:
    return {"type": "function", "name": choice.name} if isinstance(choice, Tool) else choice


def response_parse(body: dict) -> ResponseRequest:
    """Validate a POST /v1/responses body (or a WebSocket response.create); unknown fields are ignored."""
    data = validated(ResponseBody, body)
    tools = tools_parse(data.get("tools"))
    seed = data.get("seed")
    text_format = (data.get("text") or {}).get("format") or {"type": "text"}
    return ResponseRequest(
        messages=data["input"],
        instructions=data.get("instructions"),
        model=data.get("model"),
        stream=given(data, "stream", False),
        store=given(data, "store", True),
        generate=given(data, "generate", True),
        previous_response_id=data.get("previous_response_id"),
        max_output_tokens=data.get("max_output_tokens"),
        tools=tools,
        tools_echo=body.get("tools") or [],  # as the request gave them
        tool_choice=tool_choice_parse(data.get("tool_choice"), tools),
        parallel_tool_calls=given(data, "parallel_tool_calls", True),
        sampling={
            "temperature": given(data, "temperature", 1.0),
            "top_p": given(data, "top_p", 1.0),
            "seed": None if seed is None else seed % (1 << 64),
        },
        request_class=data.get("class"),
        metadata=given(data, "metadata", {}),
        deadline=data.get("deadline"),
        text_format=text_format,
        text_grammar=text_format_grammar(text_format),
        reasoning_effort=(data.get("reasoning") or {}).get("effort"),
        max_reasoning_tokens=data.get("max_reasoning_tokens"),
    )


def text_format_grammar(fmt: dict) -> str | None:
    """``text.format`` as chat's ``response_format`` grammar (param paths as this API's)."""
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return json_schema_grammar({"type": "object"}, "text.format")
    return json_schema_grammar(_schema(fmt["schema"], "text.format.schema"), "text.format.schema")


def _remap(err: IgnisError) -> IgnisError:
    """Chat-side param names as this API's."""
    err.param = {"messages": "input", "max_tokens": "max_output_tokens"}.get(err.param, err.param)
    return err


def response_prepare(req: ResponseRequest, previous: dict | None) -> PreparedResponse:
    """Render and tokenize (runs off the event loop). ``previous`` is a stored response's row."""
    served, suffix_class = model_name_resolve(req.model)
    conversation = (previous["messages"] if previous else []) + req.messages
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools = req.tools if req.tool_choice != "none" else []
    try:
        messages, vision, parts = prompt_images(served, messages)
        messages, template_tools = tools_prompt_apply(messages, tools, served.tokenizer.chat_template)
        template = served.tokenizer.chat_template
        reasons = output_parsers_for(served.tokenizer).reasoning.start in (template or "")
        kwargs = thinking_kwargs(None, req.reasoning_effort, template, param="reasoning.effort", reasons=reasons)
        prompt = chat_render(served, messages, kwargs, template_tools)
        prompt_ids, images = images_attach(served.tokenizer.encode(prompt), vision, parts, param="input")
        grammar = tool_choice_grammar(req.tool_choice, tools, req.parallel_tool_calls) or req.text_grammar
        max_tokens = generation_cap(len(prompt_ids), req.max_output_tokens)
    except IgnisError as err:
        raise _remap(err) from None
    response_id = new_id("resp")
    parsers = output_parsers_for(served.tokenizer)
    in_reasoning = parsers.reasoning.opened_by(prompt)
    budget = reasoning_budget(req.max_reasoning_tokens, req.reasoning_effort)
    add = AddRequest(
        request_id=response_id,
        reply_channel="",
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=req.sampling,
        stop_token_ids=list(served.tokenizer.eos_token_ids),
        request_class=req.request_class or suffix_class or "interactive",
        model=served.served_id,
        grammar=grammar,  # tool_choice required or named: the call is forced by grammar
        decide=not req.generate,  # generate: false prefills only, and the state is retained
        reasoning=reasoning_watch(served.tokenizer, parsers, opened=in_reasoning, budget=budget),
        images=images,
    )
    base = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": served.served_id,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning_effort, "summary": None},
        "store": req.store,
        "temperature": req.sampling["temperature"],
        "text": {"format": req.text_format},
        "tool_choice": _tool_choice_echo(req.tool_choice),
        "tools": req.tools_echo,
        "top_p": req.sampling["top_p"],
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": req.metadata,
    }
    return PreparedResponse(
        request=req,
        served=served,
        add=add,
        conversation=conversation,
        base=base,
        in_reasoning=in_reasoning,
    )


# -- the store -----------------------------------------------------------------


@database_sync_to_async
def stored_response_get(response_id: str) -> dict:
    from apps.api.models import StoredResponse

    row = StoredResponse.objects.filter(id=response_id).values("messages", "response", "model").first()
    if row is None:
        raise PreviousResponseNotFound(
            f"Previous response with id '{response_id}' not found.", param="previous_response_id"
        )
    return row


@database_sync_to_async
def stored_response_save(*, response: dict, messages: list[dict]) -> None:
    """Keep a finished response for previous_response_id; the oldest go past ``server.responses_keep``."""
    from apps.api.models import StoredResponse

    StoredResponse.objects.create(id=response["id"], model=response["model"], messages=messages, response=response)
    keep = settings.IGNIS["server.responses_keep"]
    stale = StoredResponse.objects.order_by("-created_at").values_list("id", flat=True)[keep : keep + 100]
    if stale:
        StoredResponse.objects.filter(id__in=list(stale)).delete()


async def response_prepare_async(req: ResponseRequest) -> PreparedResponse:
    import asyncio

    previous = await stored_response_get(req.previous_response_id) if req.previous_response_id else None
    return await asyncio.to_thread(response_prepare, req, previous)


@database_sync_to_async
def stored_response_delete(response_id: str) -> bool:
    from apps.api.models import StoredResponse

    deleted, _ = StoredResponse.objects.filter(id=response_id).delete()
    return deleted > 0
