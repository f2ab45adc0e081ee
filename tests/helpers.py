"""Assertion and waiting helpers shared by API and end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def assert_openai_error(resp, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The response is ``status`` with a complete OpenAI error envelope; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def wait_for(
    probe: Callable[[], T],
    timeout: float = 60.0,
    interval: float = 0.1,
    message: str = "the condition",
    *,
    until: Callable[[T], object] = bool,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``probe`` every ``interval`` seconds until ``until(value)`` holds and return that value.

    The one polling loop of the suite: a test waits on a condition the server
    exposes (GET /v1/models, /health, /metrics, the log) with a bounded
    deadline, never on a sleep. Past ``timeout`` seconds it raises an
    AssertionError naming ``message`` and the last value seen. An exception of
    a type in ``ignoring`` (a server mid-restart, a stale page element) counts
    as "not yet" and is the last value seen; any other propagates at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
            if until(value):
                return value
        except ignoring as exc:
            value = exc
        if time.monotonic() >= deadline:
            seen = repr(value)
            seen = seen if len(seen) <= 2000 else seen[:2000] + "..."
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value seen: {seen}")
        time.sleep(interval)
