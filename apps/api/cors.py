"""CORS for the API: ``server.cors_origins`` (comma-separated origins, ``*`` for any; default none).

``CorsGate`` wraps the ASGI application outside the key gate, because the
streaming routes are Channels consumers that Django's middleware (and so
django-cors-headers) never sees, and because a browser's preflight carries no
``Authorization`` header: the key gate would refuse it.

* A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
  on ``/v1/`` is answered here: 204 with the ``Access-Control-Allow-*`` headers
  for an allowed origin, 403 ``origin_not_allowed`` for another.
* Any other ``/v1/`` answer to an allowed origin carries
  ``Access-Control-Allow-Origin`` (errors too, so a page can read them).
* A WebSocket whose ``Origin`` is neither the server's own nor allowed is
  accepted and closed at once with 4403 (the browser sends ``Origin``; other
  clients send none and pass).

A page served by ignis itself (same scheme-less host and port) is never cross-origin.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from django.conf import settings

from apps.api.auth import is_preflight, websocket_refuse
from apps.core.errors import IgnisError

CORS_PREFIX = "/v1/"
ALLOW_METHODS = b"GET, POST, PATCH, DELETE, OPTIONS"
DEFAULT_ALLOW_HEADERS = b"authorization, content-type"
EXPOSE_HEADERS = b"retry-after, www-authenticate"
MAX_AGE = b"600"


def allowed_origins() -> tuple[str, ...]:
    """The configured origins (read at each call: ``server.cors_origins`` can change on a running server)."""
    raw = settings.IGNIS.get("server.cors_origins") or ""
    return tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())


def header(headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def same_origin(origin: bytes, headers) -> bool:
    """``Origin`` names the host the request was sent to (the Playground's own page)."""
    host = header(headers, b"host")
    return host is not None and urlsplit(origin.decode("latin-1")).netloc.lower() == host.decode("latin-1").lower()


def origin_allowed(origin: bytes) -> bool:
    origins = allowed_origins()
    return "*" in origins or origin.decode("latin-1").rstrip("/") in origins


def response_headers(headers) -> list[tuple[bytes, bytes]]:
    """The CORS headers an answer to a request with these ``headers`` carries ([] if none)."""
    origin = header(headers, b"origin")
    if origin is None or same_origin(origin, headers) or not origin_allowed(origin):
        return []
    return [
        (b"access-control-allow-origin", origin),
        (b"access-control-expose-headers", EXPOSE_HEADERS),
        (b"vary", b"Origin"),
    ]


class OriginNotAllowed(IgnisError):
    status = 403
    code = "origin_not_allowed"


class CorsGate:
    """ASGI middleware: preflights answered, CORS headers added, WebSocket origins checked."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "websocket":
            origin = header(scope.get("headers", []), b"origin")
            if origin is not None and not same_origin(origin, scope["headers"]) and not origin_allowed(origin):
                msg = f"Origin {origin.decode('latin-1')[:60]} is not in server.cors_origins."
                return await websocket_refuse(receive, send, code=4403, reason=msg)
            return await self.app(scope, receive, send)
        if scope["type"] != "http" or not path.startswith(CORS_PREFIX):
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if is_preflight(scope.get("method", ""), headers):
            return await self._preflight(headers, send)
        extra = response_headers(headers)
        if not extra:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)

    @staticmethod
    async def _preflight(headers, send) -> None:
        origin = header(headers, b"origin")
        if same_origin(origin, headers) or origin_allowed(origin):
            asked = header(headers, b"access-control-request-headers") or DEFAULT_ALLOW_HEADERS
            out = [
                (b"access-control-allow-origin", origin),
                (b"access-control-allow-methods", ALLOW_METHODS),
                (b"access-control-allow-headers", asked),
                (b"access-control-max-age", MAX_AGE),
                (b"vary", b"Origin"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": out})
            await send({"type": "http.response.body", "body": b""})
            return
        err = OriginNotAllowed(f"Origin {origin.decode('latin-1')[:200]} is not in server.cors_origins.")
        await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(err.envelope()).encode()})
