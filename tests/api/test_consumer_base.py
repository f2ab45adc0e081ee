"""The consumers' base (apps/api/consumer.py): keepalive, finishing by returning, the frame limit.

No engine: its messages are never sent, or sent by the test.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.conf import settings

from apps.api.completions.consumer import CompletionsConsumer
from apps.api.responses import socket as responses_socket

ROOT = Path(__file__).resolve().parents[2]


def test_a_waiting_stream_sends_headers_then_keepalives(offline, monkeypatch):
    """Issue 11 point 13: with no engine event at all, the headers and comments still come."""
    monkeypatch.setattr(settings, "IGNIS", {**settings.IGNIS, "server.sse_keepalive": 0.1})

    async def run():
        app = ApplicationCommunicator(
            CompletionsConsumer.as_asgi(),
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
        )
        body = {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 4, "stream": True}
        await app.send_input({"type": "http.request", "body": json.dumps(body).encode()})
        start = await app.receive_output(30)
        first = await app.receive_output(5)
        second = await app.receive_output(5)
        await app.send_input({"type": "http.disconnect"})
        await app.wait(5)
        return start, first, second

    start, first, second = asyncio.run(run())
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert first["body"] == second["body"] == b": keepalive\n\n" and first["more_body"]
    assert offline[-1][0] == "abort"  # the disconnect still aborts what was submitted


def test_no_keepalive_when_off(offline, monkeypatch):
    monkeypatch.setattr(settings, "IGNIS", {**settings.IGNIS, "server.sse_keepalive": 0})

    async def run():
        app = ApplicationCommunicator(
            CompletionsConsumer.as_asgi(),
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
        )
        body = {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 4, "stream": True}
        await app.send_input({"type": "http.request", "body": json.dumps(body).encode()})
        assert await app.receive_nothing(1.5)
        await app.send_input({"type": "http.disconnect"})
        await app.wait(5)

    asyncio.run(run())


def test_an_event_over_the_body_limit_is_an_error_event(offline, monkeypatch):
    """Issue 11 point 24, the consumer's half: answered request_too_large; the socket stays open."""
    monkeypatch.setattr(settings, "IGNIS", {**settings.IGNIS, "server.body_limit": 4096})

    async def run():
        ws = WebsocketCommunicator(responses_socket.ResponsesSocketConsumer.as_asgi(), "/v1/responses")
        assert (await ws.connect())[0]
        await ws.send_to(text_data=json.dumps({"type": "response.create", "input": "x" * 5000}))
        too_large = json.loads(await ws.receive_from(10))
        await ws.send_to(text_data=json.dumps({"type": "nope"}))
        after = json.loads(await ws.receive_from(10))
        await ws.disconnect()
        return too_large, after

    too_large, after = asyncio.run(run())
    assert too_large["type"] == "error" and too_large["error"]["code"] == "request_too_large"
    assert after["error"]["code"] == "unknown_event_type"


def test_daphne_closes_oversized_frames_with_a_reason():
    from daphne import server as daphne_server

    from ignis_site import daphne_ws

    factory = daphne_ws.ClosingWebSocketFactory(object())
    assert factory.failByDrop is False  # autobahn sends a 1009 close frame instead of dropping TCP
    assert daphne_ws.max_message_bytes(4 << 20) == 8 << 20 and daphne_ws.max_message_bytes(1024) == 1 << 20
    saved = daphne_server.WebSocketFactory
    try:
        daphne_ws.install()
        assert daphne_server.WebSocketFactory is daphne_ws.ClosingWebSocketFactory
    finally:
        daphne_server.WebSocketFactory = saved


def test_handlers_finish_by_returning():
    """StopConsumer is raised by the base's dispatch only, never from a helper or a handler."""
    raisers = []
    for path in (ROOT / "apps").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and "StopConsumer" in ast.unparse(node):
                raisers.append(str(path.relative_to(ROOT)))
    assert set(raisers) == {"apps/api/consumer.py"}, raisers
    base = ast.parse((ROOT / "apps/api/consumer.py").read_text())
    owners = {
        f.name
        for c in ast.walk(base)
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.AsyncFunctionDef)
        and any(isinstance(n, ast.Raise) and "StopConsumer" in ast.unparse(n) for n in ast.walk(f))
    }
    assert owners == {"dispatch", "websocket_connect"}, owners
