"""The Responses API over a WebSocket (``client.responses.connect()``, the openai[realtime] extra)."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosedOK
from websockets.sync.client import connect as ws_connect

from tests.e2e.server import engine_stats, lanes_busy, start_server
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
IDLE = 3  # server.socket_idle_close of the one-lane server


def until_terminal(conn) -> list:
    events = []
    for ev in conn:
        events.append(ev)
        if ev.type in TERMINAL:
            return events
    raise AssertionError(f"socket closed after {[e.type for e in events]}")


def test_events_as_on_sse(client):
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "input": "What is 2+2?", "max_output_tokens": 16, "temperature": 0})
        events = until_terminal(conn)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.id.startswith("resp_")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert "4" in final.output_text


def test_errors_leave_the_socket_open(client):
    with client.responses.connect() as conn:
        conn.send_raw("{not json")
        ev = conn.recv()
        assert ev.type == "error" and ev.error.code == "invalid_json"
        conn.send_raw(json.dumps({"type": "response.dance"}))
        ev = conn.recv()
        assert ev.type == "error" and ev.error.code == "unknown_event_type" and ev.error.param == "type"
        conn.send({"type": "response.create", "input": "hi", "previous_response_id": "resp_missing"})
        ev = conn.recv()
        assert ev.type == "error" and ev.error.code == "previous_response_not_found"
        assert ev.error.param == "previous_response_id"
        conn.send_raw(json.dumps({"type": "response.create", "input": 5}))
        ev = conn.recv()
        assert ev.type == "error" and ev.error.param == "input"
        conn.send({"type": "response.create", "input": "Say hi.", "max_output_tokens": 4, "temperature": 0})
        assert until_terminal(conn)[-1].response.output_text


def test_generate_false_warms_state_for_the_next_turn(client):
    with client.responses.connect() as conn:
        conn.send(
            {
                "type": "response.create",
                "input": "Here is a list: apples, pears, plums, figs, limes.",
                "generate": False,
                "stream_id": "s1",
            }
        )
        events = until_terminal(conn)
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
        assert all(e.stream_id == "s1" for e in events)
        warm = events[-1].response
        assert warm.output == [] and warm.usage.output_tokens == 0
        conn.send(
            {
                "type": "response.create",
                "input": "Which fruit is first?",
                "previous_response_id": warm.id,
                "max_output_tokens": 6,
                "temperature": 0,
            }
        )
        done = until_terminal(conn)[-1].response
    assert done.previous_response_id == warm.id
    assert done.usage.input_tokens_details.cached_tokens >= (warm.usage.input_tokens // 16) * 16 > 0


def test_two_creates_run_in_order(client):
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "input": "Say one.", "max_output_tokens": 3, "temperature": 0})
        conn.send({"type": "response.create", "input": "Say two.", "max_output_tokens": 3, "temperature": 0})
        a = until_terminal(conn)
        b = until_terminal(conn)
    assert a[-1].response.id != b[-1].response.id
    assert b[0].sequence_number == 0  # each response numbers its own events


def test_deadline_cuts_a_socket_response_as_over_http(client, live_server_url):
    """The request's deadline applies on the socket: an incomplete response (reason deadline) with the
    output so far, its sequence aborted in the engine; the socket stays open and the next response runs.
    The story outlasts the 2 s deadline by far (thousands of tokens asked), so the cut is what ends it."""
    idle = wait_for(
        lambda: engine_stats(live_server_url), 30, 0.05, "no lane busy before", until=lambda s: s.get("lanes_busy") == 0
    )
    aborted = idle["aborted"]
    with client.responses.connect() as conn:
        conn.send(
            {
                "type": "response.create",
                "input": "Write a long story about a dragon.",
                "max_output_tokens": 4000,
                "temperature": 0,
                "deadline": 2,
            }
        )
        events = until_terminal(conn)
        cut = events[-1].response
        assert events[-1].type == "response.incomplete", f"not cut: {events[-1].type} {cut.usage}"
        assert cut.incomplete_details.reason == "deadline" and 0 < cut.usage.output_tokens < 4000
        wait_for(
            lambda: engine_stats(live_server_url),
            10,
            0.05,
            "the cut sequence to be aborted and its lane freed",
            until=lambda s: s.get("aborted") == aborted + 1 and s.get("lanes_busy") == 0,
        )
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == cut.output_text
        conn.send({"type": "response.create", "input": "Say hi.", "max_output_tokens": 3, "temperature": 0})
        after = until_terminal(conn)
    assert after[-1].response.id != cut.id and after[0].sequence_number == 0


# -- one lane, short idle timeout ------------------------------------------------------------


@pytest.fixture(scope="module")
def one_lane(tmp_path_factory, default_gguf_path):
    proc, base = start_server(
        tmp_path_factory.mktemp("ws"),
        "--model-idle-unload",
        "0",
        "--spec-decode-lanes",
        "1",
        "--server-socket-idle-close",
        str(IDLE),
    )
    yield base
    proc.stop()


def test_busy_lanes_queue_a_socket_request(one_lane):
    client = OpenAI(base_url=one_lane + "/v1", api_key="unused", max_retries=0, timeout=300)
    held = threading.Event()

    def hold_the_lane():
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            max_tokens=40,
            temperature=0,
            messages=[{"role": "user", "content": "Tell me a long story."}],
        )
        held.set()

    holder = threading.Thread(target=hold_the_lane)
    holder.start()
    wait_for(lambda: lanes_busy(one_lane), 60, 0.05, "the holder to take the lane", until=lambda n: n == 1)
    with pytest.raises(openai.InternalServerError) as refused:  # over HTTP: 503 engine_full
        client.responses.create(input="hi", max_output_tokens=2)
    assert refused.value.status_code == 503 and refused.value.body["code"] == "engine_full"
    with client.responses.connect() as conn:  # over the socket: queued until the lane frees
        conn.send({"type": "response.create", "input": "Say hi.", "max_output_tokens": 4, "temperature": 0})
        events = until_terminal(conn)
        assert held.wait(10), "answered once the holder had finished"
    holder.join()
    assert not [e for e in events if e.type == "error"]
    assert events[-1].response.output_text


def test_closing_the_socket_frees_the_lane(one_lane):
    client = OpenAI(base_url=one_lane + "/v1", api_key="unused", max_retries=0, timeout=300)
    with client.responses.connect() as conn:
        conn.send({"type": "response.create", "input": "Tell me a very long story.", "max_output_tokens": 400})
        for ev in conn:
            if ev.type == "response.output_text.delta":
                break
        assert lanes_busy(one_lane) == 1
    wait_for(lambda: lanes_busy(one_lane), 10, 0.05, "the closed socket's lane to free", until=lambda n: n == 0)


def test_idle_socket_is_closed(one_lane):
    """Closed by the server (a 1000 close frame it sent first) once nothing was in flight for
    ``server.socket_idle_close``: never before, as the clock is read before the last thing the socket
    received was sent. (Daphne drops the close reason, so "idle" is not on the wire.)"""
    with ws_connect(one_lane.replace("http", "ws") + "/v1/responses") as ws:
        t0 = time.monotonic()  # <= the server's last activity: the frame below is sent after this
        ws.send(json.dumps({"type": "nope"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "error"
        with pytest.raises(ConnectionClosedOK) as closed:
            ws.recv(timeout=IDLE + 30)  # a bound on the wait, not a window
        assert time.monotonic() - t0 >= IDLE, "closed before it had been idle for the timeout"
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000 and closed.value.rcvd_then_sent
