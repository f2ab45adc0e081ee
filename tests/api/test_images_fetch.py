"""http(s) image URLs (apps/api/images/acquire.py) against a real local HTTP server: off by
default, only listed hosts, loopback refused even when listed unless server.image_fetch_private,
no redirects, the size limit (declared and streamed), the timeout; and the address checks."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.conf import settings
from PIL import Image

from apps.api.images import VisionSpec, image_prepare
from apps.api.images.acquire import address_refused, host_allowed, image_bytes
from apps.api.images.errors import InvalidImage
from apps.api.images.processor import ProcessorConfig

PNG = io.BytesIO()
Image.new("RGB", (60, 40), (200, 30, 90)).save(PNG, "PNG")
PNG = PNG.getvalue()


class Handler(BaseHTTPRequestHandler):
    release: threading.Event

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/cat.png":
            self._send(200, PNG)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/big":
            self.send_response(200)
            self.send_header("Content-Length", str(10 << 20))
            self.end_headers()
        elif self.path == "/stream":  # no length: the reader stops at the limit
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 4096)
        elif self.path == "/hang":  # headers never come; the fetch gives up at its timeout
            self.release.wait(30)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    handler = type("H", (Handler,), {"release": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    handler.release.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def fetching(monkeypatch):
    def configure(**values):
        for key, value in {"server.image_fetch": True, **values}.items():
            monkeypatch.setitem(settings.IGNIS, key, value)

    return configure


def _refusal(url: str, words: str) -> None:
    with pytest.raises(InvalidImage) as info:
        image_bytes(url, param="messages[0].content[0]")
    assert info.value.code == "invalid_image" and info.value.param == "messages[0].content[0]"
    assert words in info.value.message, info.value.message


def test_fetching_is_off_by_default(server):
    assert settings.IGNIS["server.image_fetch"] is False
    _refusal(f"{server}/cat.png", "server.image_fetch is off")


def test_only_listed_hosts_and_loopback_only_when_allowed(server, fetching):
    fetching(**{"server.image_fetch_hosts": "images.example.com"})
    _refusal(f"{server}/cat.png", "not in server.image_fetch_hosts")
    fetching(**{"server.image_fetch_hosts": "127.0.0.1"})
    _refusal(f"{server}/cat.png", "loopback address")  # listed, still refused
    fetching(**{"server.image_fetch_hosts": "images.example.com, 127.0.0.1", "server.image_fetch_private": True})
    assert image_bytes(f"{server}/cat.png", param="p") == PNG
    _refusal(server.replace("127.0.0.1", "localhost") + "/cat.png", "not in server.image_fetch_hosts")


def test_a_fetched_image_is_prepared_like_a_data_url(server, fetching):
    import base64

    fetching(**{"server.image_fetch_hosts": "127.0.0.1", "server.image_fetch_private": True})
    spec = VisionSpec(image_token_id=7, processor=ProcessorConfig())
    fetched = image_prepare({"image_url": {"url": f"{server}/cat.png"}, "param": "p"}, spec)
    inline = image_prepare({"image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}, "param": "p"}, spec)  # fmt: skip
    assert fetched.hash == inline.hash and fetched.grid_thw == inline.grid_thw == (1, 4, 6)


def test_no_redirects_no_errors_no_oversize_no_hang(server, fetching):
    fetching(**{
        "server.image_fetch_hosts": "127.0.0.1", "server.image_fetch_private": True,
        "server.image_fetch_max_bytes": 64 << 10, "server.image_fetch_timeout": 0.5,
    })  # fmt: skip
    _refusal(f"{server}/redirect", "redirects are not followed")
    _refusal(f"{server}/missing", "HTTP 404")
    _refusal(f"{server}/big", "the limit is 65536")
    _refusal(f"{server}/stream", "over the 65536-byte limit")
    _refusal(f"{server}/hang", "did not answer within 0.5 s")
    _refusal("http://user:pw@127.0.0.1/cat.png", "credentials")


def test_address_checks():
    for address, why in [
        ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"), ("10.1.2.3", "private"),
        ("192.168.0.9", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
        ("0.0.0.0", "reserved"), ("224.0.0.1", "reserved"), ("100.64.0.1", "non-global"),
    ]:  # fmt: skip
        assert address_refused(address, allow_private=False) == why, address
    assert address_refused("8.8.8.8", allow_private=False) is None
    assert address_refused("2606:4700::1111", allow_private=False) is None
    assert address_refused("10.1.2.3", allow_private=True) is None
    assert address_refused("127.0.0.1", allow_private=True) is None
    assert address_refused("169.254.169.254", allow_private=True) == "link-local"  # cloud metadata: never


def test_host_allow_list():
    allowed = ["images.example.com", "*.cdn.example.org"]
    assert host_allowed("IMAGES.example.com", allowed) and host_allowed("a.b.cdn.example.org", allowed)
    assert not host_allowed("cdn.example.org", allowed) and not host_allowed("evilcdn.example.org", allowed)
    assert not host_allowed("images.example.com.evil.net", allowed) and not host_allowed("x", [])
