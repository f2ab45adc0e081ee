"""Fixtures the API tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def offline(monkeypatch):
    """No engine behind the consumers: what they submit is captured in the returned list (each
    ``AddRequest``, and ``("abort", request_id)`` for an abort), and the model switch's gate and
    hold pass straight through."""
    from apps.api import consumer
    from apps.api.responses import socket as responses_socket
    from apps.core import engine_client

    submitted = []

    async def nothing(**kw):
        return None

    async def submit(add):
        submitted.append(add)

    async def abort(request_id):
        submitted.append(("abort", request_id))

    for module in (consumer, responses_socket):
        monkeypatch.setattr(module, "switch_gate", nothing)
        monkeypatch.setattr(module, "model_hold", nothing)
    monkeypatch.setattr(engine_client, "request_submit", submit)
    monkeypatch.setattr(engine_client, "request_abort", abort)
    return submitted
