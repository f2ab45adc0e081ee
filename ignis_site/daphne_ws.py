"""Daphne's WebSocket limits, wired to the API's.

Daphne (autobahn) drops the TCP connection when a frame passes its size limit:
no close frame, no reason. ``install`` makes it close properly instead (1009
"message too big" with its reason), and ``max_message_bytes`` sets that limit
above ``server.body_limit`` so a frame over the body limit reaches the consumer,
which answers it with an ``error`` event (request_too_large) as HTTP answers 413.
"""

from __future__ import annotations

from daphne import server as daphne_server
from daphne.ws_protocol import WebSocketFactory


class ClosingWebSocketFactory(WebSocketFactory):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.setProtocolOptions(failByDrop=False)  # a failed frame gets a close frame and a reason


def install() -> None:
    """Before ``Server.run()``: Daphne builds its WebSocket factory from this name."""
    daphne_server.WebSocketFactory = ClosingWebSocketFactory


def max_message_bytes(body_limit: int) -> int:
    """Daphne's frame and message limit: twice the body limit (at least 1 MiB), so the
    consumer sees, and answers, frames up to there; past it, a 1009 close."""
    return max(2 * body_limit, 1 << 20)
