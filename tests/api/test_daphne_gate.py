"""The gate inside Daphne's HTTP server: refusals on the headers, the read timeout (in memory, a fake clock)."""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from ignis_site import daphne_gate


class Server:
    """What Daphne's request asks of its server before the application is made."""

    proxy_forwarded_address_header = None
    root_path = ""

    def __init__(self):
        self.applications = 0

    def protocol_connected(self, protocol):
        pass

    def protocol_disconnected(self, protocol):
        pass

    def create_application(self, protocol, scope):
        self.applications += 1
        return None  # "abandoned": enough to see the request got through


@pytest.fixture
def gate(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(daphne_gate, "clock", clock)
    cfg = {**settings.IGNIS, "server.api_keys": "sk-1", "server.body_limit": 4096, "server.read_timeout": 3.0}
    monkeypatch.setattr(settings, "IGNIS", cfg)
    server = Server()
    protocol = daphne_gate.GatedHTTPFactory(server).buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport, clock, server


def head(length: int, *extra: str, path: str = "/v1/chat/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(transport) -> tuple[int, dict, dict]:
    top, _, body = transport.value().partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_no_key_is_401_before_any_body_byte(gate):
    protocol, transport, clock, server = gate
    protocol.dataReceived(head(256 << 20, "Expect: 100-continue"))
    status, headers, body = answer(transport)
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    assert headers["connection"] == "close" and b"100 Continue" not in transport.value()
    protocol.dataReceived(b"x" * 65536)  # the rest is discarded, not buffered
    assert server.applications == 0 and not transport.disconnecting
    clock.advance(daphne_gate.LINGER_SECONDS)
    assert transport.disconnecting


def test_a_declared_length_over_the_limit_is_413(gate):
    protocol, transport, _, _ = gate
    protocol.dataReceived(head(10 << 30, "Authorization: Bearer sk-1"))
    status, _, body = answer(transport)
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_a_refused_body_that_ends_closes_at_once(gate):
    protocol, transport, _, server = gate
    protocol.dataReceived(head(10, "Authorization: Bearer sk-nope") + b"0123456789")
    assert answer(transport)[0] == 401 and transport.disconnecting and server.applications == 0


def test_a_slow_body_is_408_at_the_read_timeout(gate):
    protocol, transport, clock, server = gate
    protocol.dataReceived(head(100, "Authorization: Bearer sk-1"))
    for _ in range(5):  # a byte a second: Twisted's idle timer would never fire
        protocol.dataReceived(b" ")
        clock.advance(0.5)
    assert transport.value() == b""
    clock.advance(1.0)
    status, _, body = answer(transport)
    assert status == 408 and body["error"]["code"] == "request_timeout" and transport.disconnecting
    assert server.applications == 0


def test_a_good_request_goes_through_and_stops_the_clock(gate):
    protocol, transport, clock, server = gate
    protocol.dataReceived(head(2, "Authorization: Bearer sk-1") + b"{}")
    assert server.applications == 1 and transport.value() == b""
    clock.advance(60)
    assert transport.value() == b""  # the timer stopped with the request complete


def test_routes_outside_the_gate_pass(gate):
    protocol, _, _, server = gate
    protocol.dataReceived(head(2, path="/admin/login/") + b"{}")
    assert server.applications == 1
