"""Tools and structured output: validation, the tool prompt, and the grammars that constrain decoding.

* ``tools_parse`` / ``tool_choice_parse`` validate the request's function tools.
* ``tools_prompt_apply`` puts the tools in front of the model: through the chat
  template when the template knows ``tools``, else as a Hermes-style system
  block; earlier assistant tool calls and tool results are written back in the
  same ``<tool_call>`` / ``<tool_response>`` format.
* ``response_format_grammar`` and ``tool_choice_grammar`` build llguidance
  grammars (a JSON schema, or a Lark grammar whose calls embed each tool's
  parameter schema) that the engine applies to every sampled token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rest_framework.exceptions import ValidationError

from apps.api.parsers import json_loads
from apps.api.schemas import validated
from apps.api.schemas.fields import Body
from apps.api.schemas.tools import MAX_SCHEMA_CHARS, MAX_TOOLS, ResponseFormat, Tools, schema_checked  # noqa: F401
from apps.core.errors import InvalidRequest

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: small models wander in free whitespace


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _schema(value: Any, param: str) -> dict:
    try:
        return schema_checked(value)
    except ValidationError as exc:
        raise InvalidRequest(str(exc.detail[0]), param=param, code=exc.detail[0].code) from None


class _ToolsBody(Body):
    tools = Tools()
    response_format = ResponseFormat()


def tools_parse(value: Any) -> list[Tool]:
    """The request's function tools (chat's nested shape or the Responses API's flat one), declared by
    apps.api.schemas.tools.Tools; 400 naming ``tools[i].function.name`` (or ``tools[i].name``)."""
    tools = validated(_ToolsBody, {"tools": value}).get("tools") or []
    return [Tool(t["name"], t["description"], t["parameters"]) for t in tools]


def tool_choice_parse(value: Any, tools: list[Tool]) -> str | Tool:
    """'none' | 'auto' | 'required' | the named Tool."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidRequest("'tool_choice' must be none, auto, required or a named function.", param="tool_choice")
        if value == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs 'tools'.", param="tool_choice")
        return value
    name = None
    if isinstance(value, dict):
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        name = fn.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(
            'A named tool_choice is {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
            code="invalid_type",
        )
    for tool in tools:
        if tool.name == name:
            return tool
    raise InvalidRequest(f"tool_choice names {name!r}, which is not among 'tools'.", param="tool_choice")


# -- the prompt -------------------------------------------------------------------------


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_system_block(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
        "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
        f"about what values to plug into functions. Here are the available tools:\n<tools>\n{lines}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>'
    )


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    try:  # a string that is not JSON (or holds what the body parser refuses) is written as it came
        args = json_loads(args) if isinstance(args, str) else args
    except InvalidRequest:
        pass
    return (
        "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    )


def tools_prompt_apply(messages: list[dict], tools: list[Tool], template: str | None) -> tuple[list[dict], list | None]:
    """(messages, tools for the template): a tool-aware template gets both as they are; any other
    template gets the Hermes system block and tool turns written as text."""
    if template_knows_tools(template):
        return messages, [t.openai() for t in tools] or None
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(_call_text(c) for c in m["tool_calls"] if isinstance(c, dict))
            m = {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        else:
            m = {k: v for k, v in m.items() if k in ("role", "content", "name")}
        out.append(m)
    if tools:
        block = tools_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


# -- grammars ----------------------------------------------------------------------------


def _check(grammar: str, param: str) -> str:
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise InvalidRequest(f"This schema cannot constrain decoding: {problem}", param=param, code="invalid_schema")
    return grammar


def json_schema_grammar(schema: dict, param: str) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequest(
            f"This schema cannot constrain decoding: {exc}", param=param, code="invalid_schema"
        ) from None
    return _check(grammar, param)


def response_format_grammar(value: Any) -> tuple[str | None, str]:
    """(grammar or None, the format's type) for ``response_format`` (declared: ResponseFormat)."""
    fmt = validated(_ToolsBody, {"response_format": value}).get("response_format")
    if fmt is None:
        return None, "text"
    kind = fmt["type"]
    if kind == "text":
        return None, kind
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format"), kind
    schema = fmt["json_schema"].get("schema") or {}
    return json_schema_grammar(schema, "response_format.json_schema.schema"), kind


def tool_choice_grammar(choice: str | Tool, tools: list[Tool], parallel: bool) -> str | None:
    """A grammar forcing one (or, with parallel calls, one or more) well-formed tool calls; None for none/auto."""
    if isinstance(choice, str) and choice != "required":
        return None
    import llguidance

    targets = [choice] if isinstance(choice, Tool) else tools
    alts = []
    for t in targets:
        schema = {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        alts.append("%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
    lark = "start: call" + (' ("\\n" call)*' if parallel else "") + "\n"
    lark += 'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
    lark += "body: " + " | ".join(alts) + "\n"
    return _check(llguidance.LLMatcher.grammar_from_lark(lark), "tools")
