"""Issue 11 point 24: a large Responses WebSocket frame is answered, never a dropped connection.

Before: any frame over ~1 MiB (Daphne's default limit) dropped the TCP
connection with no close frame and no error event. Now a frame within
``server.body_limit`` (4 MiB by default) is answered as HTTP answers the same
body, one over it with an ``error`` event ``request_too_large`` (HTTP: 413), the
socket staying open; past twice the limit Daphne closes with 1009 and a reason.
"""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

pytestmark = pytest.mark.e2e

MiB = 1 << 20
MODEL = "smollm2-135m-instruct"


def _frame(size: int) -> str:
    event = {"type": "response.create", "model": MODEL, "input": "", "max_output_tokens": 4}
    event["input"] = "hello " * ((size - len(json.dumps(event))) // 6)
    return json.dumps(event)


def _ws_url(base: str) -> str:
    return base.replace("http://", "ws://", 1) + "/v1/responses"


def test_frame_over_one_mib_is_answered_as_http_answers_it(live_server_url):
    frame = _frame(int(1.5 * MiB))
    http = httpx.post(live_server_url + "/v1/responses", content=frame, timeout=120)
    with ws_connect(_ws_url(live_server_url), max_size=None, open_timeout=30) as ws:
        ws.send(frame)
        event = json.loads(ws.recv(timeout=120))
        assert event["type"] == "error"
        assert event["error"]["code"] == http.json()["error"]["code"]
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Hi", "max_output_tokens": 2}))
        while (event := json.loads(ws.recv(timeout=120)))["type"] not in ("response.completed", "response.incomplete"):
            assert event["type"] != "error", event


def test_frame_over_the_body_limit_is_an_error_event(live_server_url):
    with ws_connect(_ws_url(live_server_url), max_size=None, open_timeout=30) as ws:
        ws.send(_frame(5 * MiB))
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error" and event["error"]["code"] == "request_too_large"
        ws.send(json.dumps({"type": "nope"}))  # the socket is still open and answering
        assert json.loads(ws.recv(timeout=60))["error"]["code"] == "unknown_event_type"


def test_frame_past_daphnes_limit_gets_a_close_frame_with_a_reason(live_server_url):
    with ws_connect(_ws_url(live_server_url), max_size=None, open_timeout=30) as ws:
        with pytest.raises(ConnectionClosed) as closed:  # the close can cut the send short, or come after it
            ws.send(_frame(9 * MiB))
            ws.recv(timeout=60)
    assert closed.value.rcvd is not None, "the connection was dropped without a close frame"
    assert closed.value.rcvd.code == 1009 and closed.value.rcvd.reason
