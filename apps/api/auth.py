"""API keys and the body limit, checked before anything else runs.

``ApiGate`` wraps the ASGI application: a request on a protected route (every
``/v1/`` route, HTTP and the Responses WebSocket, and the Playground's
``/ui/api/`` data routes) whose ``Authorization: Bearer <key>`` is not one of
the configured keys is answered 401 ``authentication_error`` at once -- no
consumer or view is built, the engine never hears of it. A declared
``Content-Length`` over ``server.body_limit`` is answered 413 the same way
(consumers also count the bytes of bodies sent without one). A refused
WebSocket is accepted and closed at once with code 4401 and the message as its
reason: a browser's ``WebSocket`` can read a close code, not an HTTP status.

Daphne reads a whole request body before the ASGI application is called, so
for a request with a body the same checks (``refusal``) also run on its
headers alone, inside the HTTP server (``ignis_site/daphne_gate.py``).

Open without a key: ``/health`` (status only; the engine's details need a key,
``key_presented``), the Playground's page and assets under ``/ui/``, the admin
(its own login), and CORS preflights (they never carry credentials).

Keys come from ``server.api_keys`` (comma-separated) and ``server.api_keys_file``
(one a line, ``#`` comments; re-read when it changes). No key configured means
no authentication. Keys are compared with ``hmac.compare_digest`` against every
configured key, so the time taken says nothing about how close a guess was.
"""

from __future__ import annotations

import hmac
import json
import os
import threading

from django.conf import settings

from apps.core.errors import AuthenticationError, BodyTooLarge, IgnisError

PROTECTED_PREFIXES = ("/v1/", "/ui/api/")

_file_lock = threading.Lock()
_file_cache: dict[str, tuple[float, tuple[str, ...]]] = {}


def _file_keys(path: str) -> tuple[str, ...]:
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return ()
    with _file_lock:
        hit = _file_cache.get(path)
        if hit is None or hit[0] != mtime:
            with open(path, encoding="utf-8") as f:
                keys = tuple(s for line in f if (s := line.split("#", 1)[0].strip()))
            hit = _file_cache[path] = (mtime, keys)
        return hit[1]


def api_keys() -> tuple[str, ...]:
    """The configured keys (read at each call: ``server.api_keys`` can change on a running server)."""
    cfg = settings.IGNIS
    keys = tuple(k.strip() for k in (cfg.get("server.api_keys") or "").split(",") if k.strip())
    path = cfg.get("server.api_keys_file") or ""
    return keys + (_file_keys(path) if path else ())


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant time in the presented key's content: every configured key is compared, always."""
    given = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def bearer_of(headers) -> str | None:
    """The Bearer token of ASGI ``headers`` (a list of byte pairs), or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def authenticate(headers) -> None:
    """Raise AuthenticationError unless the request carries a configured key (or none is configured)."""
    keys = api_keys()
    if not keys:
        return
    token = bearer_of(headers)
    if token is None:
        raise AuthenticationError(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    if not key_matches(token, keys):
        raise AuthenticationError("Incorrect API key provided.")


def key_presented(headers) -> bool:
    """True when no key is configured or ``headers`` carry a configured one."""
    try:
        authenticate(headers)
    except AuthenticationError:
        return False
    return True


def is_preflight(method: str, headers) -> bool:
    """A CORS preflight: OPTIONS with Origin and Access-Control-Request-Method (never credentials)."""
    names = {name.lower() for name, _ in headers}
    return method == "OPTIONS" and b"origin" in names and b"access-control-request-method" in names


def refusal(*, kind: str, method: str, path: str, headers, length: int | None) -> IgnisError | None:
    """Why a request is refused on its headers alone (a bad key, then a declared length over the limit), or None.

    ``length`` is the declared Content-Length (None: none declared). The key comes
    first: a stranger learns nothing about limits.
    """
    if not path.startswith(PROTECTED_PREFIXES) or (kind == "http" and is_preflight(method, headers)):
        return None
    try:
        authenticate(headers)
    except IgnisError as err:
        return err
    limit = settings.IGNIS["server.body_limit"]
    if kind == "http" and (length or 0) > limit:
        return BodyTooLarge(f"The request body is over the {limit}-byte limit.")
    return None


def declared_length(headers) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class ApiGate:
    """ASGI middleware: keys, then the declared body size, for every protected route."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = scope.get("headers", [])
            err = refusal(
                kind=scope["type"],
                method=scope.get("method", "GET"),
                path=scope.get("path", ""),
                headers=headers,
                length=declared_length(headers),
            )
            if err is not None:
                return await self._refuse(scope, receive, send, err)
        return await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope, receive, send, err: IgnisError) -> None:
        if scope["type"] == "websocket":
            await websocket_refuse(receive, send, code=4401, reason=err.message)
            return
        headers = [(b"content-type", b"application/json")]
        if err.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="ignis"'))
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(err.envelope()).encode()})


async def websocket_refuse(receive, send, *, code: int, reason: str) -> None:
    """Accept, then close with ``code`` and ``reason`` before any frame: a close before the
    accept would be an HTTP 403 at the upgrade, which no browser lets a page read."""
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": code, "reason": reason[:120]})
