"""Parsing request bodies into typed requests: the declared bodies of apps.api.schemas
(which refuse bad input naming the param), then the cross-field rules and grammars."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apps.api.schemas import given, validated
from apps.api.schemas.chat import (  # noqa: F401 - the limits' old home
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_N,
    MAX_STOP,
    MAX_STOP_LEN,
    ROLES,
    ChatBody,
    Messages,
    SamplingBody,
    Stop,
)
from apps.api.schemas.completions import CompletionBody
from apps.core.errors import IgnisError, InvalidRequest


def parse_messages(value: Any) -> list[dict]:
    """Chat messages as {role, content (text), name?, tool_call_id?, tool_calls?}; 400 naming messages[i]..."""
    return validated(ChatBody, {"messages": value})["messages"]


def parse_stop(value: Any) -> list[str]:
    return validated(SamplingBody, {"stop": value}).get("stop") or []


@dataclass
class ChatRequest:
    messages: list[dict]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)
    request_class: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list = field(default_factory=list)  # apps.api.tools.Tool
    tool_choice: Any = "none"  # none | auto | required | a Tool
    parallel_tool_calls: bool = True
    grammar: str | None = None  # llguidance grammar: response_format or a forced tool call
    response_format: str = "text"
    deadline: float | None = None  # seconds, None: server.deadline
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    reasoning_effort: str | None = None  # mapped to the template's enable_thinking (apps.api.chat.service)
    prediction: str | None = None  # Predicted Outputs' content (drafts for speculative rounds)
    max_reasoning_tokens: int | None = None  # extension: the thinking budget (else reasoning_effort's)


def _common(data: dict) -> dict:
    """The fields chat and legacy completions share, from SamplingBody's validated data."""
    seed = data.get("seed")
    max_tokens = given(data, "max_completion_tokens", data.get("max_tokens"))
    return {
        "model": data.get("model"),
        "stream": given(data, "stream", False),
        "include_usage": bool((data.get("stream_options") or {}).get("include_usage")),
        "max_tokens": max_tokens,
        "stop": given(data, "stop", []),
        "sampling": {
            "temperature": given(data, "temperature", 1.0),
            "top_p": given(data, "top_p", 1.0),
            "top_k": max(given(data, "top_k", 0), 0),  # -1 is vLLM's "off"
            "min_p": given(data, "min_p", 0.0),
            "presence_penalty": given(data, "presence_penalty", 0.0),
            "frequency_penalty": given(data, "frequency_penalty", 0.0),
            "repetition_penalty": given(data, "repetition_penalty", 1.0),
            "seed": None if seed is None else seed % (1 << 64),
            **_engine_options(data),
        },
        "request_class": data.get("class"),
        "n": given(data, "n", 1),
        "deadline": data.get("deadline"),
        "ignore_eos": given(data, "ignore_eos", False),
        "min_tokens": given(data, "min_tokens", 0),
        "logit_bias": given(data, "logit_bias", {}),
    }


def _engine_options(data: dict) -> dict:
    """ignore_eos, min_tokens and logit_bias as engine SamplingParams fields (only those given)."""
    out: dict = {}
    if data.get("ignore_eos"):
        if data.get("response_format") not in (None, {"type": "text"}):
            raise InvalidRequest(
                "'ignore_eos' cannot be combined with a structured response_format: the grammar ends the output.",
                param="ignore_eos",
            )
        out["ignore_eos"] = True
    if data.get("min_tokens"):
        out["min_tokens"] = data["min_tokens"]
    if data.get("logit_bias"):
        vocab = _vocab_size(data.get("model"))
        for token in data["logit_bias"]:
            if token >= vocab:
                raise InvalidRequest(
                    f"Token id {token} is not in the vocabulary [0, {vocab}).", param=f"logit_bias.{token}"
                )
        out["logit_bias"] = [[t, b] for t, b in data["logit_bias"].items()]
    return out


def _vocab_size(model: str | None) -> int:
    """The vocabulary of the model ``model`` names, the one its request goes to (in a fleet: that of
    the workers serving it, not the default model's)."""
    from apps.models.services import model_name_resolve, served_model

    try:
        served, _ = model_name_resolve(model)
    except IgnisError:  # a name not served here: the route answers that (404), not this check
        served = served_model()
    return served.tokenizer.vocab_size


def parse_common(body: dict) -> dict:
    """The fields chat and legacy completions share: model, stream, caps, sampling, stop, n, class, deadline."""
    return _common(validated(SamplingBody, body))


def parse_chat_request(body: dict) -> ChatRequest:
    from apps.api import tools as tool_mod

    data = validated(ChatBody, body)
    common = _common(data)
    logprobs = given(data, "logprobs", False)
    tools = tool_mod.tools_parse(data.get("tools"))
    choice = tool_mod.tool_choice_parse(data.get("tool_choice"), tools)
    parallel = given(data, "parallel_tool_calls", True)
    grammar = tool_mod.tool_choice_grammar(choice, tools, parallel)
    fmt_grammar, fmt = tool_mod.response_format_grammar(data.get("response_format"))
    return ChatRequest(
        messages=data["messages"],
        template_kwargs=given(data, "chat_template_kwargs", {}),
        logprobs=logprobs,
        top_logprobs=given(data, "top_logprobs", 0),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        grammar=grammar or fmt_grammar,
        response_format=fmt,
        reasoning_effort=data.get("reasoning_effort"),
        prediction=(data.get("prediction") or {}).get("content"),
        max_reasoning_tokens=data.get("max_reasoning_tokens"),
        **common,
    )


@dataclass
class CompletionRequest:
    """POST /v1/completions: a raw prompt (text or token ids), no template."""

    prompts: list  # each a str or a list of token ids
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)
    request_class: str | None = None
    n: int = 1
    deadline: float | None = None
    echo: bool = False
    logprobs: int | None = None  # legacy: None (off) or how many alternatives
    suffix: str | None = None
    grammar: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)


def parse_completion_request(body: dict) -> CompletionRequest:
    from apps.api.tools import response_format_grammar

    data = validated(CompletionBody, body)
    prompts = data["prompt"]
    common = _common(data)
    if len(prompts) * common["n"] > MAX_N:
        raise InvalidRequest(f"At most {MAX_N} choices (prompts times n) per request.", param="n")
    best_of = data.get("best_of")
    if best_of is not None and best_of != common["n"]:
        raise InvalidRequest("'best_of' other than n is not supported.", param="best_of")
    grammar, _ = response_format_grammar(data.get("response_format"))
    return CompletionRequest(
        prompts=prompts,
        echo=given(data, "echo", False),
        logprobs=data.get("logprobs"),
        suffix=data.get("suffix") or None,
        grammar=grammar,
        **common,
    )
