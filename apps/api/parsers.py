"""The one JSON reader of request bodies: DRF views, HTTP consumers and the Responses WebSocket.

Python's ``json`` accepts what no later step can handle: a lone surrogate
(``"\\ud800"``) decodes to a ``str`` that cannot be encoded to UTF-8 (the
tokenizer, the database, the filesystem and DRF's renderer then raise), and
deep nesting raises ``RecursionError`` in the parser or in any recursive walk
after it. Both are refused here, once, with the 400 envelope, so no route
downstream ever sees them.
"""

from __future__ import annotations

import json
from typing import Any

from rest_framework.parsers import JSONParser

from apps.core.errors import InvalidRequest

MAX_DEPTH = 64  # arrays and objects inside one another; real requests (tool schemas included) stay far below


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"The JSON body is nested more than {MAX_DEPTH} levels deep.", code="invalid_json")


def _param(path: tuple) -> str | None:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate(path: tuple, what: str = "string") -> InvalidRequest:
    return InvalidRequest(
        f"A {what} in the request holds a lone UTF-16 surrogate (such as \\ud800), which is not a Unicode character.",
        param=_param(path),
        code="invalid_unicode",
    )


def json_check(value: Any) -> Any:
    """``value`` when it nests at most MAX_DEPTH levels and no string in it holds a lone surrogate.

    Iterative (a recursive walk is what deep input breaks); ``param`` names the
    offending field the way validation does (``messages[0].content``).
    """
    if isinstance(value, str):
        if _has_surrogate(value):
            raise _surrogate(())
        return value
    stack: list[tuple[Any, tuple]] = [(value, ())] if isinstance(value, dict | list) else []
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise _too_deep()
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(key, str) and _has_surrogate(key):
                raise _surrogate(path, "key")
            if isinstance(child, str):
                if _has_surrogate(child):
                    raise _surrogate((*path, key))
            elif isinstance(child, dict | list):
                stack.append((child, (*path, key)))
    return value


def json_loads(text: str | bytes) -> Any:
    """Parse JSON text (UTF-8 when bytes), refusing NaN/Infinity, lone surrogates and deep nesting."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    return json_check(value)


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object (see ``json_loads``)."""
    body = json_loads(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


class JSONBodyParser(JSONParser):
    """DRF's parser with ``json_loads``'s refusals: every DRF view reads bodies through it."""

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        return json_loads(stream.read() if stream is not None else b"")
