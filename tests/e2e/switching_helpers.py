"""Helpers for the switching, idle-unload and config end-to-end tests."""

from __future__ import annotations

import time

import httpx

DEFAULT = "smollm2-135m-instruct"
TINY = "tiny-llama"


def models(base: str) -> dict:
    return httpx.get(base + "/v1/models", timeout=10).json()


def entry(base: str, served_id: str) -> dict:
    return next(m for m in models(base)["data"] if m["id"] == served_id)


def wait_status(base: str, served_id: str, status: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        e = next((m for m in models(base)["data"] if m["id"] == served_id), None)
        if e is not None and e["status"] == status:
            return e
        time.sleep(0.2)
    raise AssertionError(f"{served_id} never reached {status}: {models(base)}")


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
