"""CORS (server.cors_origins): preflights answered before the key gate, origins checked on the WebSocket."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.conf import settings

from apps.api.auth import ApiGate
from apps.api.cors import CorsGate

ALLOWED = "https://app.example"


class App:
    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app, *, method="POST", path="/v1/chat/completions", headers=(), kind="http"):
    sent = []

    async def receive():
        return {"type": "websocket.connect"} if kind == "websocket" else {"type": "http.request", "body": b"{}"}

    async def send(msg):
        sent.append(msg)

    raw = [(b"host", b"127.0.0.1:8080"), *((k.lower().encode(), v.encode()) for k, v in headers)]
    asyncio.run(app({"type": kind, "path": path, "method": method, "headers": raw}, receive, send))
    return sent


def hdrs(msg) -> dict:
    return {k.decode(): v.decode() for k, v in msg["headers"]}


@pytest.fixture
def cors(monkeypatch):
    cfg = {**settings.IGNIS, "server.cors_origins": ALLOWED + ", https://other.example", "server.api_keys": "sk-1"}
    monkeypatch.setattr(settings, "IGNIS", cfg)


PREFLIGHT = [
    ("Access-Control-Request-Method", "POST"),
    ("Access-Control-Request-Headers", "authorization, x-stainless-os"),
]


def test_a_preflight_from_an_allowed_origin_is_answered_without_a_key(cors):
    app = App()
    sent = call(CorsGate(ApiGate(app)), method="OPTIONS", headers=[("Origin", ALLOWED), *PREFLIGHT])
    assert app.calls == 0 and sent[0]["status"] == 204
    h = hdrs(sent[0])
    assert h["access-control-allow-origin"] == ALLOWED
    assert "POST" in h["access-control-allow-methods"]
    assert h["access-control-allow-headers"] == "authorization, x-stainless-os"


def test_a_preflight_from_another_origin_is_403(cors):
    sent = call(CorsGate(ApiGate(App())), method="OPTIONS", headers=[("Origin", "https://evil.example"), *PREFLIGHT])
    assert sent[0]["status"] == 403 and "access-control-allow-origin" not in hdrs(sent[0])
    assert json.loads(sent[1]["body"])["error"]["code"] == "origin_not_allowed"


def test_answers_to_an_allowed_origin_carry_the_header_errors_too(cors):
    app = App()
    sent = call(CorsGate(ApiGate(app)), headers=[("Origin", ALLOWED), ("Authorization", "Bearer sk-1")])
    assert app.calls == 1 and hdrs(sent[0])["access-control-allow-origin"] == ALLOWED
    sent = call(CorsGate(ApiGate(app)), headers=[("Origin", ALLOWED)])  # no key: the 401 is readable by the page
    assert sent[0]["status"] == 401 and hdrs(sent[0])["access-control-allow-origin"] == ALLOWED
    sent = call(CorsGate(ApiGate(app)), headers=[("Origin", "https://evil.example"), ("Authorization", "Bearer sk-1")])
    assert "access-control-allow-origin" not in hdrs(sent[0])


def test_no_origins_by_default(monkeypatch):
    monkeypatch.setattr(settings, "IGNIS", {**settings.IGNIS, "server.cors_origins": ""})
    sent = call(CorsGate(App()), method="OPTIONS", headers=[("Origin", ALLOWED), *PREFLIGHT])
    assert sent[0]["status"] == 403


@pytest.mark.parametrize(
    "origin,allowed",
    [(None, True), ("http://127.0.0.1:8080", True), (ALLOWED, True), ("https://evil.example", False)],
)
def test_the_websocket_origin_is_checked(cors, origin, allowed):
    app = App()
    headers = [("Authorization", "Bearer sk-1")] + ([("Origin", origin)] if origin else [])
    sent = call(CorsGate(ApiGate(app)), path="/v1/responses", headers=headers, kind="websocket")
    assert app.calls == (1 if allowed else 0)
    if not allowed:
        assert sent[0] == {"type": "websocket.accept"}
        assert sent[1]["type"] == "websocket.close" and sent[1]["code"] == 4403
