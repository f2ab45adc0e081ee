"""Helpers for the switching, idle-unload and config end-to-end tests."""

from __future__ import annotations

import httpx

from tests.helpers import wait_for

DEFAULT = "smollm2-135m-instruct"
TINY = "tiny-llama"


def models(base: str) -> dict:
    return httpx.get(base + "/v1/models", timeout=10).json()


def entry(base: str, served_id: str) -> dict:
    return next(m for m in models(base)["data"] if m["id"] == served_id)


def wait_status(base: str, served_id: str, status: str, timeout: float = 120.0) -> dict:
    """``served_id``'s entry in GET /v1/models once its status is ``status``."""
    body = wait_for(
        lambda: models(base),
        timeout,
        0.2,
        f"{served_id} to be {status} in GET /v1/models",
        until=lambda b: any(m["id"] == served_id and m["status"] == status for m in b["data"]),
    )
    return next(m for m in body["data"] if m["id"] == served_id)


def wait_last_switch(base: str, outcome: str, timeout: float = 120.0) -> dict:
    """GET /v1/models' ``last_switch`` once no switch runs and the last one ended ``outcome``."""
    body = wait_for(
        lambda: models(base),
        timeout,
        0.2,
        f"the last switch to end {outcome!r}",
        until=lambda b: b["switching"] is None and (b["last_switch"] or {}).get("outcome") == outcome,
    )
    return body["last_switch"]


def chat(base: str, model: str | None = None, timeout: float = 180.0, **kw) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": kw.pop("prompt", "What is 2+2?")}],
        "max_tokens": 8,
        "temperature": 0,
        **kw,
    }
    if model is not None:
        body["model"] = model
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout)


def switch(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/models/switch", json=body, timeout=30)
