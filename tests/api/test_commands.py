"""The operator's commands: serve --help, model list / download, the start announcement, the log formats."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from types import SimpleNamespace

import pytest
from django.core.management import call_command

from apps.models.management.commands import serve
from ignis_site.jsonlog import JsonFormatter, TextFormatter


def test_serve_help_shows_every_default():
    text = " ".join(serve.Command().create_parser("manage.py", "serve").format_help().split())
    assert "(default: 4194304)" in text  # server.body_limit
    assert "(default: 60.0)" in text  # server.read_timeout
    assert "(default: json)" in text  # server.log_format
    assert "(default: smollm2-135m-instruct) [IGNIS_MODEL_ID]" in text
    assert "--port INT alias of --server-port (default: 8080)" in text


@pytest.mark.django_db
def test_model_list_has_a_header(default_gguf_path):
    out = io.StringIO()
    call_command("model", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["ID", "STATE", "FORMAT", "SIZE", "PATH", "SOURCE"]
    assert lines[1].startswith("smollm2-135m-instruct ")


@pytest.mark.django_db
def test_model_download_of_a_verified_file_does_nothing(default_gguf_path, monkeypatch):
    def fetch(**kwargs):
        raise AssertionError("fetched a file that was on disk and verified")

    monkeypatch.setattr("apps.models.catalog.artifact_download_run", fetch)
    out = io.StringIO()
    call_command("model", "download", "smollm2-135m-instruct", stdout=out)
    assert "nothing to do" in out.getvalue()


def test_serving_is_announced_once_the_model_serves(monkeypatch):
    """Not when the port opens: the line comes after the engine reports serving."""
    replies = iter([None, SimpleNamespace(status="loading"), SimpleNamespace(status="serving", model="m-1")])
    asked = []

    async def engine_status(timeout=2.0):
        asked.append(1)
        return next(replies)

    monkeypatch.setattr("apps.core.engine_client.engine_status", engine_status)
    out = io.StringIO()
    asyncio.run(serve.announce_when_serving(out, "http://127.0.0.1:8080/", "embedded", interval=0))
    assert len(asked) == 3
    assert out.getvalue() == "ignis serving m-1 at http://127.0.0.1:8080/ (engine: embedded)"


def record(**fields) -> logging.LogRecord:
    rec = logging.LogRecord("ignis.engine", logging.INFO, __file__, 1, "ignis.model.loaded", None, None)
    rec.__dict__.update(fields)
    return rec


def test_the_log_formats():
    rec = record(model="smollm2-135m-instruct", seconds=4.37, path="a b")
    entry = json.loads(JsonFormatter().format(rec))
    assert entry["event"] == "ignis.model.loaded" and entry["seconds"] == 4.37
    line = TextFormatter().format(rec)
    assert not line.startswith("{")
    assert 'info    ignis.model.loaded  model=smollm2-135m-instruct seconds=4.37 path="a b"' in line


def test_a_python_warning_is_one_log_record(caplog):
    import warnings

    from ignis_site import jsonlog

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        jsonlog.capture_warnings()
        with caplog.at_level(logging.WARNING, logger="ignis.python"):
            warnings.warn("running as root:\n  not recommended", UserWarning, stacklevel=1)
    rec = next(r for r in caplog.records if r.getMessage() == "ignis.python.warning")
    assert rec.category == "UserWarning" and rec.text == "running as root: not recommended"
