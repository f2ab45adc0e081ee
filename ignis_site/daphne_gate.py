"""Daphne, refusing a request on its headers and bounding how long it may take to arrive.

Twisted (under Daphne) buffers a whole request body before the ASGI
application is called, so the ASGI key gate alone answers a 256 MiB upload
without a key only at its end, and a declared ``Content-Length`` of 10 GB with
no body hangs until the client gives up. ``GatedRequest`` runs the same checks
(``apps.api.auth.refusal``) as soon as the headers are in (Twisted's
``gotLength``): a refused request is answered at once (401 or 413, the OpenAI
envelope, CORS headers for an allowed origin, ``Connection: close``). Its body
is never buffered nor passed on; what still arrives is discarded for at most
``LINGER_SECONDS`` (closing a socket with unread bytes sends a reset, and a
client still uploading would lose the answer), then the connection is closed.

Twisted's idle timeout restarts with every byte, so one byte every few seconds
kept a connection forever. ``server.read_timeout`` bounds the whole arrival,
headers and body together, from the request line: past it the request is
answered 408 ``request_timeout`` and closed. The clock stops once the request
is complete (a long stream is the application's business, not this one's).
"""

from __future__ import annotations

import json
import logging
from urllib.parse import unquote

from daphne import server as daphne_server
from daphne.http_protocol import HTTPFactory, WebRequest
from django.conf import settings
from twisted.internet import reactor  # after daphne.server, which installs the asyncio reactor

from apps.api import cors
from apps.api.auth import refusal
from apps.core.errors import IgnisError

log = logging.getLogger("ignis.server")

REASONS = {401: b"Unauthorized", 408: b"Request Timeout", 413: b"Content Too Large"}
LINGER_SECONDS = 5.0
clock = reactor  # the timers' clock (a twisted.internet.task.Clock in tests)


class RequestTimeout(IgnisError):
    status = 408
    code = "request_timeout"


class GatedRequest(WebRequest):
    """Daphne's request, checked on its headers and bounded in time until it is complete."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._refused = False
        self._linger = None
        timeout = float(settings.IGNIS.get("server.read_timeout") or 0)
        self._read_timer = clock.callLater(timeout, self._read_timed_out) if timeout > 0 else None

    def gotLength(self, length):
        super().gotLength(length)
        if length == 0:
            return  # nothing to wait for: the ASGI gate answers at once, with CORS
        headers = [(name.lower(), value) for name, values in self.requestHeaders.getAllRawHeaders() for value in values]
        # The request line is parsed into the channel (Twisted's private names) until the body is in.
        target = self.channel._path.split(b"?", 1)[0]
        try:
            path = unquote(target.decode("ascii"))
        except UnicodeDecodeError:
            return  # Daphne answers 400 for this path once the request is in
        err = refusal(
            kind="http", method=self.channel._command.decode("latin-1"), path=path, headers=headers, length=length
        )
        if err is not None:
            self._refuse(err, headers)

    def handleContentChunk(self, data):
        if not self._refused:
            super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        self._stop_timers()
        if self._refused:
            self.channel.loseConnection()  # the refused body is all in: nothing unread to reset on
            return
        super().requestReceived(command, path, version)

    def connectionLost(self, reason):
        self._stop_timers()
        super().connectionLost(reason)

    def _stop_timers(self) -> None:
        for timer in (self._read_timer, self._linger):
            if timer is not None and timer.active():
                timer.cancel()
        self._read_timer = self._linger = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._refused or self.channel is None:
            return
        limit = settings.IGNIS.get("server.read_timeout")
        log.info("ignis.request.read_timeout", extra={"seconds": limit, "client": str(self.client)})
        headers = [(name.lower(), value) for name, values in self.requestHeaders.getAllRawHeaders() for value in values]
        self._refuse(RequestTimeout(f"The request did not arrive within {limit} seconds."), headers, linger=False)

    def _refuse(self, err: IgnisError, headers, *, linger: bool = True) -> None:
        """Answer ``err`` on the raw transport; close once the body is in, or ``LINGER_SECONDS`` on."""
        self._stop_timers()
        self._refused = True
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after the answer
        body = json.dumps(err.envelope()).encode()
        lines = [
            b"HTTP/1.1 %d %s" % (err.status, REASONS.get(err.status, b"Error")),
            b"Content-Type: application/json",
            b"Content-Length: %d" % len(body),
            b"Connection: close",
        ]
        if err.status == 401:
            lines.append(b'WWW-Authenticate: Bearer realm="ignis"')
        lines += [name + b": " + value for name, value in cors.response_headers(headers)]
        channel = self.channel
        channel.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        if linger:
            self._linger = clock.callLater(LINGER_SECONDS, channel.loseConnection)
        else:
            channel.loseConnection()


class GatedHTTPFactory(HTTPFactory):
    def buildProtocol(self, addr):
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = GatedRequest
        return protocol


class IgnisServer(daphne_server.Server):
    """Daphne's server with the gated request: ``Server.run`` builds its HTTP factory from
    ``daphne.server.HTTPFactory``, so that name is pointed at ours for the run."""

    def run(self):
        daphne_server.HTTPFactory = GatedHTTPFactory
        return super().run()
