"""The API-key gate: checked before anything else, in constant time, from config and a file."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.conf import settings

from apps.api import auth


class App:
    """The application behind the gate: records whether it was reached at all."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(gate, path="/v1/chat/completions", headers=(), kind="http", method="POST"):
    sent, body_reads = [], []

    async def receive():
        body_reads.append(1)
        return {"type": "websocket.connect"} if kind == "websocket" else {"type": "http.request", "body": b"{}"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": kind, "path": path, "method": method, "headers": [(k.encode(), v.encode()) for k, v in headers]}
    asyncio.run(gate(scope, receive, send))
    return sent, body_reads


@pytest.fixture
def keys(monkeypatch, tmp_path):
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("# ops keys\nsk-file-1\n\nsk-file-2  # rotated 2026\n")
    cfg = {
        **settings.IGNIS,
        "server.api_keys": "sk-one, sk-two",
        "server.api_keys_file": str(keyfile),
        "server.body_limit": 4096,
    }
    monkeypatch.setattr(settings, "IGNIS", cfg)
    return keyfile


@pytest.mark.parametrize("key", ["sk-one", "sk-two", "sk-file-1", "sk-file-2"])
def test_configured_keys_pass(keys, key):
    app = App()
    sent, _ = call(auth.ApiGate(app), headers=[("Authorization", f"Bearer {key}")])
    assert app.calls == 1 and sent[0]["status"] == 200


@pytest.mark.parametrize(
    "headers,code",
    [
        ([], "missing_api_key"),
        ([("Authorization", "Basic sk-one")], "missing_api_key"),
        ([("Authorization", "Bearer sk-on")], "invalid_api_key"),
        ([("Authorization", "Bearer sk-one2")], "invalid_api_key"),
        ([("Authorization", "Bearer ")], "invalid_api_key"),
        ([("Authorization", "Bearer # ops keys")], "invalid_api_key"),
    ],
)
def test_a_bad_key_is_401_and_touches_nothing(keys, headers, code):
    app = App()
    sent, body_reads = call(auth.ApiGate(app), headers=headers)
    assert app.calls == 0 and body_reads == []  # no consumer, no view, the body not even read
    assert sent[0]["status"] == 401
    err = json.loads(sent[1]["body"])["error"]
    assert err["type"] == "authentication_error" and err["code"] == code


def test_routes_outside_v1_are_open_and_websockets_are_closed(keys):
    app = App()
    for path in ("/health", "/ui/", "/ui/static/playground/app.js", "/admin/login/"):
        sent, _ = call(auth.ApiGate(app), path=path)
    assert app.calls == 4
    sent, _ = call(auth.ApiGate(app), path="/v1/responses", kind="websocket")
    # Accepted, then closed with 4401: a close before the accept is an HTTP 403 no browser lets a page read.
    assert app.calls == 4
    assert sent[0] == {"type": "websocket.accept"}
    assert sent[1]["type"] == "websocket.close" and sent[1]["code"] == 4401
    assert sent[1]["reason"].startswith("You didn't provide an API key.")
    assert len(sent) == 2


@pytest.mark.parametrize("headers", [[], [("Authorization", "Bearer sk-wrong")]])
def test_the_monitor_route_takes_the_one_gate(keys, headers):
    """/ui/api/monitor: refused by the gate (keys from server.api_keys_file too), not by code of its own."""
    app = App()
    sent, _ = call(auth.ApiGate(app), path="/ui/api/monitor", headers=headers)
    assert app.calls == 0 and sent[0]["status"] == 401
    sent, _ = call(auth.ApiGate(app), path="/ui/api/monitor", headers=[("Authorization", "Bearer sk-file-2")])
    assert app.calls == 1 and sent[0]["status"] == 200


def test_the_monitor_view_has_no_key_check_of_its_own():
    import inspect

    from apps.playground import views

    assert "api_keys" not in inspect.getsource(views)


def test_health_details_need_a_key(keys):
    assert not auth.key_presented([])
    assert not auth.key_presented([(b"authorization", b"Bearer sk-nope")])
    assert auth.key_presented([(b"authorization", b"Bearer sk-file-1")])


def test_a_preflight_passes_the_key_gate(keys):
    app = App()
    headers = [("Origin", "https://app.example"), ("Access-Control-Request-Method", "POST")]
    call(auth.ApiGate(app), path="/v1/chat/completions", headers=headers, method="OPTIONS")
    assert app.calls == 1


def test_declared_body_over_the_limit_is_413_after_the_key(keys):
    app = App()
    sent, _ = call(auth.ApiGate(app), headers=[("Authorization", "Bearer sk-one"), ("Content-Length", "5000")])
    assert app.calls == 0 and sent[0]["status"] == 413
    sent, _ = call(auth.ApiGate(app), headers=[("Content-Length", "5000")])
    assert sent[0]["status"] == 401  # the key first: a stranger learns nothing about limits


def test_key_file_is_reread_when_it_changes(keys):
    import os

    keys.write_text("sk-new\n")
    os.utime(keys, (1, 1))  # a different mtime than the first read
    assert "sk-new" in auth.api_keys() and "sk-file-1" not in auth.api_keys()


def test_no_keys_means_no_auth(monkeypatch):
    monkeypatch.setattr(settings, "IGNIS", {**settings.IGNIS, "server.api_keys": "", "server.api_keys_file": ""})
    app = App()
    call(auth.ApiGate(app))
    assert app.calls == 1


def test_comparison_checks_every_key():
    seen = []
    import hmac

    real = hmac.compare_digest

    def spy(a, b):
        seen.append(b)
        return real(a, b)

    auth.hmac.compare_digest = spy
    try:
        assert auth.key_matches("k1", ("k1", "k2", "k3"))
    finally:
        auth.hmac.compare_digest = real
    assert seen == [b"k1", b"k2", b"k3"]  # no early exit on the first match
