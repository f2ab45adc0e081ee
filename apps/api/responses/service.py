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
from apps.api.errors import IgnisError, InvalidRequest, PreviousResponseNotFound
from apps.api.output_parsers import output_parsers_for
from apps.api.responses.events import new_id
from apps.api.tools import Tool, tool_choice_grammar, tool_choice_parse, tools_parse, tools_prompt_apply
from apps.api.validation import _integer, _number, _text_of
from apps.models.services import ServedModel, model_name_resolve
from engine.messages import AddRequest

MAX_ITEMS = 2048
INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


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


@dataclass
class PreparedResponse:
    request: ResponseRequest
    served: ServedModel
    add: AddRequest  # reply_channel is filled in by the consumer
    conversation: list[dict]  # previous messages + the new input (no instructions)
    base: dict  # the Response object before any output
    in_reasoning: bool = False  # the prompt opened <think> itself


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean.", param=name, code="invalid_type")
    return value


def _optional_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string.", param=name, code="invalid_type")
    return value


def _input_item(item: Any, param: str) -> dict:
    if not isinstance(item, dict):
        raise InvalidRequest("Each input item must be an object.", param=param, code="invalid_type")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str):  # a list or object is not even hashable: never a dict lookup
            raise InvalidRequest(
                f"'role' must be a string: one of {', '.join(INPUT_ROLES)}.", param=f"{param}.role", code="invalid_type"
            )
        if role not in INPUT_ROLES:
            raise InvalidRequest(
                f"Unknown role {role!r}; expected one of {', '.join(INPUT_ROLES)}.", param=f"{param}.role"
            )
        return {"role": INPUT_ROLES[role], "content": _text_of(item.get("content"), f"{param}.content")}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise InvalidRequest(
                    f"A function_call item needs a string '{key}'.", param=f"{param}.{key}", code="invalid_type"
                )
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            ],
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(
                "A function_call_output item needs a string 'call_id'.", param=f"{param}.call_id", code="invalid_type"
            )
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": text}
    if kind == "reasoning":
        return {}  # earlier reasoning is not part of the next prompt
    raise InvalidRequest(f"Input items of type {kind!r} are not supported.", param=f"{param}.type")


def _messages_of(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("'input' must be a string or an array of input items.", param="input", code="invalid_type")
    if len(value) > MAX_ITEMS:
        raise InvalidRequest(f"At most {MAX_ITEMS} input items.", param="input")
    messages = [m for i, item in enumerate(value) if (m := _input_item(item, f"input[{i}]"))]
    merged: list[dict] = []  # consecutive function calls are one assistant turn
    for m in messages:
        if merged and m.get("tool_calls") and merged[-1].get("tool_calls") and not m["content"]:
            merged[-1]["tool_calls"] += m["tool_calls"]
        else:
            merged.append(m)
    return merged


def _tool_choice_echo(choice: str | Tool) -> Any:
    return {"type": "function", "name": choice.name} if isinstance(choice, Tool) else choice


def response_parse(body: dict) -> ResponseRequest:
    """Validate a POST /v1/responses body (or a WebSocket response.create); unknown fields are ignored."""
    if body.get("input") is None:
        raise InvalidRequest("'input' is required.", param="input", code="missing_required_parameter")
    messages = _messages_of(body["input"])
    tools = tools_parse(body.get("tools"))
    request_class = body.get("class")
    if request_class is not None and request_class not in ("interactive", "agent"):
        raise InvalidRequest("'class' must be 'interactive' or 'agent'.", param="class")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object.", param="metadata", code="invalid_type")
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    deadline = None
    if body.get("deadline") is not None:
        deadline = _number(body, "deadline", 0.0, 0.0, settings.IGNIS.get("server.deadline_max", 3600.0), lo_open=True)
    return ResponseRequest(
        messages=messages,
        instructions=_optional_str(body, "instructions"),
        model=_optional_str(body, "model"),
        stream=_bool(body, "stream", False),
        store=_bool(body, "store", True),
        generate=_bool(body, "generate", True),
        previous_response_id=_optional_str(body, "previous_response_id"),
        max_output_tokens=_integer(body, "max_output_tokens", 1, 1 << 30),
        tools=tools,
        tools_echo=body.get("tools") or [],
        tool_choice=tool_choice_parse(body.get("tool_choice"), tools),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        sampling={
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            "seed": None if seed is None else seed % (1 << 64),
        },
        request_class=request_class,
        metadata=metadata,
        deadline=deadline,
    )


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
        messages, template_tools = tools_prompt_apply(messages, tools, served.tokenizer.chat_template)
        prompt = chat_render(served, messages, None, template_tools)
        prompt_ids = served.tokenizer.encode(prompt)
        grammar = tool_choice_grammar(req.tool_choice, tools, req.parallel_tool_calls)
        max_tokens = generation_cap(len(prompt_ids), req.max_output_tokens)
    except IgnisError as err:
        raise _remap(err) from None
    response_id = new_id("resp")
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
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.sampling["temperature"],
        "text": {"format": {"type": "text"}},
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
        in_reasoning=output_parsers_for(served.tokenizer).reasoning.opened_by(prompt),
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
