"""Idle unload on a live server (--model-idle-unload 2) serving the tiny checkpoint."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.e2e.server import start_server
from tests.e2e.switching_helpers import TINY, chat, entry, models, switch, wait_last_switch, wait_status
from tests.helpers import assert_openai_error, wait_for
from tests.models.tiny import models_dir_with_two

pytestmark = pytest.mark.e2e
IDLE = 2


@pytest.fixture(scope="module")
def live(tmp_path_factory, default_gguf_path):
    root = tmp_path_factory.mktemp("idle")
    mdir = models_dir_with_two(root / "models", default_gguf_path, "tiny-b")
    proc, base = start_server(
        root / "var",
        "--model-id",
        TINY,
        "--model-path",
        TINY,
        "--model-idle-unload",
        str(IDLE),
        "--switch-known-models",
        f"{TINY},tiny-b",
        env_extra={"IGNIS_SERVER_MODELS_DIR": str(mdir)},
    )
    yield base, mdir, proc
    proc.stop()


def _plan_zero(base: str) -> bool:
    engine = httpx.get(base + "/health", timeout=10).json()["engine"]
    return all(v == 0 for v in engine["plan"].values())


def test_unloads_when_idle_and_polling_does_not_keep_it(live):
    base, _, proc = live
    assert chat(base).status_code == 200

    def status_while_polling() -> str:  # reads of /v1/config and /v1/models count for nothing
        httpx.get(base + "/v1/config", timeout=5)
        return entry(base, TINY)["status"]

    wait_for(status_while_polling, IDLE + 10, 0.2, f"{TINY} to unload while polled", until=lambda s: s == "unloaded")
    assert _plan_zero(base)
    assert models(base)["last_switch"] is None
    assert "ignis.model.unloaded" in proc.log_text()


def test_next_request_reloads_and_waiters_share_the_load(live):
    base, _, proc = live
    wait_status(base, TINY, "unloaded", timeout=IDLE + 10)
    results = []
    threads = [threading.Thread(target=lambda: results.append(chat(base, TINY))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
    assert entry(base, TINY)["status"] == "serving"
    assert proc.log_text().count("ignis.model.reloaded") >= 1
    assert models(base)["last_switch"] is None  # an unload and a reload are not switches


def test_long_stream_keeps_the_model_loaded(live):
    base, _, proc = live
    assert chat(base).status_code == 200
    before = proc.log_text().count("ignis.model.unloaded")
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 1900, "stream": True, "temperature": 1.0}
    t0, seen = time.monotonic(), []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        for _line in r.iter_lines():
            if time.monotonic() - t0 > IDLE + 1 and not seen:
                seen.append(entry(base, TINY)["status"])
    elapsed = time.monotonic() - t0
    if elapsed > IDLE + 1:
        assert seen == ["serving"]
    assert proc.log_text().count("ignis.model.unloaded") == before


def test_load_failure_then_a_successful_retry(live):
    base, mdir, _ = live
    wait_status(base, TINY, "unloaded", timeout=IDLE + 10)
    weights = mdir / TINY / "model.safetensors"
    weights.rename(weights.with_suffix(".bak"))
    try:
        assert_openai_error(chat(base, TINY), 503, "model_load_failed")
        assert entry(base, TINY)["status"] == "failed"
    finally:
        weights.with_suffix(".bak").rename(weights)
    resp = chat(base, TINY)
    assert resp.status_code == 200, resp.text
    assert entry(base, TINY)["status"] == "serving"


def test_switch_racing_an_idle_unload(live):
    """A switch lands on one side of the idle unload or the other: before it (the model still
    serving: the switch tears it down) or after it (unloaded: the switch only loads). Both sides are
    driven on purpose, switching at once and after waiting for the unload, and the log says which
    side each switch landed on: an ``ignis.model.unloaded`` between the last request and the switch."""
    base, _, proc = live
    for side in ("serving", "unloaded"):
        assert chat(base, TINY).status_code == 200
        mark = len(proc.events())
        if side == "unloaded":
            wait_status(base, TINY, "unloaded", timeout=IDLE + 10)
        else:
            assert entry(base, TINY)["status"] == "serving"
        resp = switch(base, model="tiny-b")
        assert resp.status_code == 202, resp.text
        last = wait_last_switch(base, "switched", timeout=60)
        assert last["from"] == TINY and last["to"] == "tiny-b", last
        since = [
            e for e in proc.events()[mark:] if e.get("event") in ("ignis.model.unloaded", "ignis.model.switch_started")
        ]
        started = next(i for i, e in enumerate(since) if e["event"] == "ignis.model.switch_started")
        assert since[started]["to"] == "tiny-b", since
        unloads = since[:started]
        landed = "unloaded" if unloads else "serving"
        assert landed == side, f"meant to switch while {side}, landed while {landed}: {since}"
        if landed == "unloaded":
            assert [e["model"] for e in unloads] == [TINY] and unloads[0]["idle_seconds"] >= IDLE
        assert entry(base, "tiny-b")["status"] == "serving"
        assert chat(base, "tiny-b").status_code == 200
        assert chat(base, TINY).status_code == 200  # and back, implicitly
