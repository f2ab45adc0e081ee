"""What an operator and a browser front end meet on a live server: keys refused on the headers,
slow bodies bounded, CORS, the WebSocket refusal, the admin's static files."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.e2e.server import start_server

pytestmark = pytest.mark.e2e
KEY = "sk-operator-1"
ORIGIN = "https://app.example"
READ_TIMEOUT = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_gguf_path):
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text("sk-from-file\n")
    proc, base = start_server(
        tmp_path_factory.mktemp("operators"),
        "--model-idle-unload",
        "0",
        "--server-api-keys",
        KEY,
        "--server-api-keys-file",
        str(keyfile),
        "--server-read-timeout",
        str(READ_TIMEOUT),
        "--server-cors-origins",
        ORIGIN,
    )
    yield base, proc
    proc.stop()


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def raw_exchange(base: str, head: str, *, wait: float) -> tuple[bytes, float]:
    """Send only the request's headers, then read what comes back within ``wait`` seconds,
    and how long the first byte of the answer took."""
    sock = socket.create_connection(("127.0.0.1", port_of(base)), timeout=wait)
    start = time.monotonic()
    first = None
    try:
        sock.sendall(head.encode())
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            first = first if first is not None else time.monotonic() - start
            data += chunk
            if answered(data):
                break
        return data, first if first is not None else float("inf")
    finally:
        sock.close()


def answered(data: bytes) -> bool:
    """A whole HTTP answer (headers and its Content-Length of body) is in ``data``."""
    top, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in top.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def head(path: str, length: int, *extra: str) -> str:
    return (
        "\r\n".join(
            [
                f"POST {path} HTTP/1.1",
                "Host: 127.0.0.1",
                "Content-Type: application/json",
                f"Content-Length: {length}",
                *extra,
            ]
        )
        + "\r\n\r\n"
    )


def test_no_key_is_refused_on_the_headers(server):
    """A 256 MiB upload without a key is 401 before its first body byte (today: only after all of it)."""
    base, _ = server
    data, took = raw_exchange(base, head("/v1/chat/completions", 256 << 20), wait=10)
    assert data.startswith(b"HTTP/1.1 401"), data[:200]
    assert b'"code": "missing_api_key"' in data and took < 5
    data, _ = raw_exchange(base, head("/v1/tokenize", 256 << 20, "Authorization: Bearer sk-nope"), wait=10)
    assert data.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in data


def test_a_declared_length_over_the_limit_is_413_at_once(server):
    """Content-Length of 10 GB and no body: 413 at once (today: a hang until the client gives up)."""
    base, _ = server
    data, took = raw_exchange(base, head("/v1/tokenize", 10 << 30, f"Authorization: Bearer {KEY}"), wait=10)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"request_too_large" in data and took < 5


def test_a_slow_body_is_cut_at_the_read_timeout(server):
    """One byte a second keeps Twisted's idle timer alive forever; server.read_timeout bounds the whole arrival."""
    base, _ = server
    sock = socket.create_connection(("127.0.0.1", port_of(base)), timeout=READ_TIMEOUT + 10)
    start = time.monotonic()
    try:
        sock.sendall(head("/v1/tokenize", 200, f"Authorization: Bearer {KEY}").encode())
        sock.setblocking(False)
        data = b""
        while time.monotonic() - start < READ_TIMEOUT + 8:
            try:
                sock.send(b" ")
            except OSError:
                break
            time.sleep(0.5)
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        took = time.monotonic() - start
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"request_timeout" in data
    assert READ_TIMEOUT - 0.5 <= took <= READ_TIMEOUT + 3


def test_an_upload_refused_on_its_headers_still_reads_the_answer(server):
    """A client that sends its whole (too big) body before reading gets the 413, not a reset."""
    base, _ = server
    r = httpx.post(
        base + "/v1/chat/completions",
        content=b" " * (5 << 20),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(base + "/v1/tokenize", content=b" " * (3 << 20), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_a_whole_request_within_the_limits_still_passes(server):
    base, _ = server
    r = httpx.post(
        base + "/v1/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": "Bearer sk-from-file"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["count"] > 0


def test_cors_preflight_and_headers(server):
    """A browser page at an allowed origin: preflight 204 without a key, answers carry Allow-Origin."""
    base, _ = server
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = httpx.options(base + "/v1/chat/completions", headers=pre)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"]
    r = httpx.options(base + "/v1/models", headers={**pre, "Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.get(base + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(base + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def ws_close_code(base: str, headers: dict) -> int:
    url = base.replace("http://", "ws://") + "/v1/responses"
    with ws_connect(url, additional_headers=headers, open_timeout=10) as conn:
        with pytest.raises(ConnectionClosed) as info:
            conn.recv(timeout=10)
    return info.value.rcvd.code


def test_websocket_refusals_are_close_codes_a_client_can_read(server):
    """A missing or wrong key: the upgrade succeeds, then close 4401 with the reason (today: HTTP 403)."""
    base, _ = server
    assert ws_close_code(base, {}) == 4401
    assert ws_close_code(base, {"Authorization": "Bearer sk-nope"}) == 4401
    assert ws_close_code(base, {"Authorization": f"Bearer {KEY}", "Origin": "https://evil.example"}) == 4403
    url = base.replace("http://", "ws://") + "/v1/responses"
    with ws_connect(url, additional_headers={"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}, open_timeout=10):
        pass  # an allowed origin with a key opens


def test_the_monitor_takes_keys_from_the_key_file(server):
    """/ui/api/monitor goes through the one gate: server.api_keys_file counts (today it was ignored)."""
    base, _ = server
    assert httpx.get(base + "/ui/api/monitor").status_code == 401
    assert httpx.get(base + "/ui/api/monitor", headers={"Authorization": "Bearer sk-from-file"}).status_code == 200


def test_health_without_a_key_shows_status_only(server):
    base, _ = server
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert "engine" in httpx.get(base + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()


def test_the_admin_is_styled(server):
    """The admin's stylesheet is served by the ASGI app (whitenoise), not a 404 (today: an unstyled admin)."""
    base, _ = server
    page = httpx.get(base + "/admin/login/", timeout=10)
    assert page.status_code == 200 and "/static/admin/css/base.css" in page.text
    css = httpx.get(base + "/static/admin/css/base.css", timeout=10)
    assert css.status_code == 200, css.status_code
    assert css.headers["content-type"].startswith("text/css") and "body" in css.text
