"""An image part's bytes: a ``data:`` URL always; ``http(s)`` only when ``server.image_fetch`` is on.

A fetch goes only to a host on ``server.image_fetch_hosts`` (exact names, or ``*.example.com``
for its subdomains), follows no redirect, and connects only to an address it has checked
after resolving the name: loopback, private, link-local, multicast, reserved and unspecified
addresses are refused, a listed ``127.0.0.1`` included. ``server.image_fetch_private`` lets an
operator whose images live on their own host or network allow a listed host's loopback and
private addresses; link-local ones (cloud metadata at 169.254.169.254) never. The socket
connects to the checked address itself (TLS still verifies the certificate for the name), so
a second DNS answer cannot swap it. At most ``server.image_fetch_max_bytes`` are read, within
``server.image_fetch_timeout`` seconds for the whole fetch.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import ssl
import time
from urllib.parse import unquote_to_bytes, urlsplit

from django.conf import settings

from apps.api.images.errors import InvalidImage


def image_bytes(url: str, *, param: str) -> bytes:
    """The bytes an image part's URL names (its data, or the fetched body)."""
    if not isinstance(url, str) or not url:
        raise InvalidImage("An image part needs a URL: a data: URL or, where allowed, http(s).", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url_bytes(url, param=param)
    if scheme in ("http", "https"):
        return fetch(url, param=param)
    raise InvalidImage(f"Unsupported image URL scheme {scheme[:20]!r}: use a data: URL.", param=param)


def data_url_bytes(url: str, *, param: str) -> bytes:
    """``data:[<media type>][;base64],<data>`` (RFC 2397) as bytes."""
    head, sep, data = url[5:].partition(",")
    if not sep:
        raise InvalidImage("A data: URL needs a ',' before its data.", param=param)
    params = [p.strip().lower() for p in head.split(";")]
    media = params[0]  # none named: the bytes say what they are (the decoder sniffs them)
    if media and not media.startswith("image/") and media != "application/octet-stream":
        raise InvalidImage(f"A data: URL for an image names an image/* type, not {media[:40]!r}.", param=param)
    if "base64" in params[1:]:
        try:
            return base64.b64decode("".join(data.split()), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidImage("The data: URL's base64 does not decode.", param=param) from None
    return unquote_to_bytes(data)


def host_allowed(host: str, allowed: list[str]) -> bool:
    """``host`` is listed, or a subdomain of a ``*.domain`` entry (names compared lower-case)."""
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.strip().lower().rstrip(".")
        if not entry:
            continue
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and host != entry[2:]:
                return True
        elif host == entry:
            return True
    return False


def address_refused(address: str, *, allow_private: bool) -> str | None:
    """Why ``address`` may not be fetched from, or None."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local:
        return "link-local"
    if ip.is_loopback:  # before is_reserved: ::1 lies in IPv6's reserved ::/8
        return None if allow_private else "loopback"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return "reserved"
    if ip.is_private:
        return None if allow_private else "private"
    if not ip.is_global:
        return "non-global"
    return None


def _resolve(host: str, port: int, *, param: str, allow_private: bool) -> str:
    """The first address of ``host``; refused if any of its addresses is (no choosing the good one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise InvalidImage(f"The image host {host!r} does not resolve.", param=param) from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        why = address_refused(address, allow_private=allow_private)
        if why is not None:
            raise InvalidImage(f"The image host {host!r} resolves to a {why} address; not fetched.", param=param)
    return addresses[0]


class _Pinned(http.client.HTTPConnection):
    """Connects to the address already checked, not to a fresh resolution of the name."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self):
        self.sock = self.held = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self):
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.held = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch(url: str, *, param: str) -> bytes:
    """GET an http(s) image under the fetch rules (module docstring); InvalidImage on any refusal."""
    cfg = settings.IGNIS
    if not cfg.get("server.image_fetch", False):
        raise InvalidImage(
            "This server does not fetch image URLs (server.image_fetch is off): send the image as a data: URL.",
            param=param,
        )
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidImage("The image URL does not parse.", param=param) from None
    host = parts.hostname or ""
    if parts.username or parts.password:
        raise InvalidImage("An image URL may not carry credentials.", param=param)
    allowed = [h for h in str(cfg.get("server.image_fetch_hosts", "")).split(",") if h.strip()]
    if not host or not host_allowed(host, allowed):
        raise InvalidImage(f"The image host {host[:100]!r} is not in server.image_fetch_hosts.", param=param)
    timeout = float(cfg.get("server.image_fetch_timeout", 10.0))
    limit = int(cfg.get("server.image_fetch_max_bytes", 16 << 20))
    deadline = time.monotonic() + timeout
    address = _resolve(host, port, param=param, allow_private=bool(cfg.get("server.image_fetch_private", False)))
    conn_class = _PinnedTLS if parts.scheme == "https" else _Pinned
    conn = conn_class(host, port, address, timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "ignis"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise InvalidImage(f"The image URL answered a redirect ({resp.status}); redirects are not followed.", param=param)  # fmt: skip
        if resp.status != 200:
            raise InvalidImage(f"The image URL answered HTTP {resp.status}.", param=param)
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise InvalidImage(f"The image is {int(length)} bytes; the limit is {limit}.", param=param)
        body = bytearray()
        while len(body) <= limit:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            conn.held.settimeout(left)  # the whole fetch within the timeout, not each read
            chunk = resp.read1(64 << 10)
            if not chunk:
                break
            body += chunk
        if len(body) > limit:
            raise InvalidImage(f"The image is over the {limit}-byte limit.", param=param)
        return bytes(body)
    except TimeoutError:
        raise InvalidImage(f"The image URL did not answer within {timeout:g} s.", param=param) from None
    except (OSError, http.client.HTTPException) as exc:
        raise InvalidImage(f"The image could not be fetched: {type(exc).__name__}.", param=param) from None
    finally:
        conn.close()
