"""One readable start: the log is JSON (or text with server.log_format), Celery logs through it,
and "serving at URL" comes once the model serves."""

from __future__ import annotations

import json

import pytest

from tests.e2e.server import start_server
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def lines_once_celery_is_ready(proc, *markers: str) -> list[str]:
    """The server's output (stdout and stderr) once every marker is in it: the embedded Celery worker's
    ready line and the model's (they come in either order: the worker and the load start together)."""
    text = wait_for(proc.log_text, 60, 0.2, "the Celery worker and the model to be ready",
                    until=lambda t: all(m in t for m in markers))  # fmt: skip
    return [line for line in text.splitlines() if line.strip()]


def test_the_default_start_is_json_with_one_serving_line(tmp_path, default_gguf_path):
    proc, base = start_server(tmp_path, "--model-idle-unload", "0", "--server-metrics-bind", "")
    try:
        lines = lines_once_celery_is_ready(proc, '"ignis.celery.ready"', "ignis serving ")
    finally:
        proc.stop()
    serving = [i for i, line in enumerate(lines) if line.startswith("ignis serving ")]
    assert len(serving) == 1, lines
    others = [line for i, line in enumerate(lines) if i != serving[0]]
    not_json = [line for line in others if not line.startswith("{")]
    assert not not_json, not_json  # no Celery banner, no raw warning, no progress bar in a file
    events = [json.loads(line) for line in others]
    names = [e["event"] for e in events]
    assert "ignis.celery.ready" in names
    # The URL is announced after the model has loaded, not when the port opened.
    loaded_at = next(i for i, line in enumerate(lines) if '"ignis.model.loaded"' in line)
    assert serving[0] > loaded_at
    assert f"at {base}/" in lines[serving[0]]
    assert any(e["event"] == "ignis.server.serving" and e["url"] == base + "/" for e in events)


def test_text_format_is_for_people(tmp_path, default_gguf_path):
    proc, _ = start_server(
        tmp_path,
        "--model-idle-unload",
        "0",
        "--server-metrics-bind",
        "",
        env_extra={"IGNIS_SERVER_LOG_FORMAT": "text"},
    )
    try:
        lines = lines_once_celery_is_ready(proc, "ignis.celery.ready", "ignis.model.loaded")
    finally:
        proc.stop()
    assert not [line for line in lines if line.startswith("{")], lines
    loaded = [line for line in lines if "ignis.model.loaded" in line]
    assert loaded and " info " in loaded[0] and "model=smollm2-135m-instruct" in loaded[0]
