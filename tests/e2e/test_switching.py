"""Switching between two real models on a live server: explicit, implicit, refused, restored, failed."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx
import pytest

from tests.e2e.server import start_server
from tests.e2e.switching_helpers import DEFAULT, TINY, chat, entry, models, switch, wait_last_switch, wait_status
from tests.helpers import assert_openai_error, wait_for
from tests.models.tiny import models_dir_with_two

pytestmark = pytest.mark.e2e
DRAIN = 2  # --switch-drain-timeout


@pytest.fixture(scope="module")
def live(tmp_path_factory, default_gguf_path):
    root = tmp_path_factory.mktemp("switching")
    mdir = models_dir_with_two(root / "models", default_gguf_path, "broken-llama")
    (mdir / "broken-llama" / "model.safetensors").write_bytes(b"not a safetensors file")  # config reads, load fails
    outside = root / "outside"
    outside.mkdir()
    os.symlink(outside, mdir / "escape")
    proc, base = start_server(
        root / "var",
        "--model-idle-unload",
        "0",
        "--switch-drain-timeout",
        str(DRAIN),
        "--switch-known-models",
        f"{TINY},broken-llama",
        env_extra={"IGNIS_SERVER_MODELS_DIR": str(mdir)},
    )
    # /health answers 200 from the engine's first beat, "unloaded" included; the start's load follows it.
    wait_status(base, DEFAULT, "serving")
    yield base, mdir, proc
    proc.stop()


def test_models_list_every_servable_model(live):
    base, _, _ = live
    body = models(base)
    ids = [m["id"] for m in body["data"]]
    assert ids[0] == DEFAULT and TINY in ids and "broken-llama" in ids
    assert entry(base, DEFAULT)["status"] == "serving"
    assert entry(base, TINY)["status"] == "unloaded"
    assert body["switching"] is None


def test_two_names_alternate_with_implicit_switching(live):
    """The spec's "two names" pitfall: each request is answered by the model it names, one switch each."""
    base, _, _ = live
    for name in (TINY, DEFAULT, TINY):
        resp = chat(base, name)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == name
        last = models(base)["last_switch"]
        assert last["outcome"] == "switched" and last["to"] == name and last["trigger"] == "implicit"
    assert entry(base, TINY)["status"] == "serving"
    assert entry(base, DEFAULT)["status"] == "unloaded"
    resp = chat(base)  # no name: whatever serves, no switch
    assert resp.status_code == 200 and resp.json()["model"] == TINY


def test_explicit_switch_202_then_409_and_503_everywhere_else(live):
    base, _, _ = live
    wait_status(base, TINY, "serving")
    t0 = time.monotonic()
    resp = switch(base, model=DEFAULT)
    assert resp.status_code == 202, resp.text
    assert resp.json()["to"] == DEFAULT
    assert_openai_error(switch(base, model=TINY), 409, "switch_in_progress")
    body = models(base)
    assert body["switching"] == {"from": TINY, "to": DEFAULT}
    assert entry(base, DEFAULT)["status"] == "switching"
    for resp in (
        chat(base),
        chat(base, DEFAULT),
        httpx.post(base + "/v1/tokenize", json={"prompt": "hi"}, timeout=10),
        httpx.patch(base + "/v1/config", json={"model.decode_share": 0.3}, timeout=10),
    ):
        err = assert_openai_error(resp, 503, "model_switching")
        assert resp.headers["retry-after"] == "5", err
    assert httpx.get(base + "/v1/config", timeout=10).status_code == 200  # reads are not refused
    wait_status(base, DEFAULT, "serving")
    print(f"switch {TINY} -> {DEFAULT}: {time.monotonic() - t0:.1f} s")
    last = models(base)["last_switch"]
    assert last["outcome"] == "switched" and last["from"] == TINY and last["trigger"] == "explicit"
    resp = chat(base, DEFAULT, max_tokens=32)
    assert resp.status_code == 200 and "4" in resp.json()["choices"][0]["message"]["content"]


def test_explicit_switches_record_their_end_without_a_task_error(live):
    """The task that records an explicit switch's end outlives the request (issue 11, point 28)."""
    base, _, proc = live
    for target in (TINY, DEFAULT):
        before = models(base)["last_switch"]
        resp = switch(base, model=target)
        assert resp.status_code == 202, resp.text
        body = wait_for(
            lambda: models(base),
            120,
            0.2,
            f"the switch to {target} to end",
            until=lambda b, before=before: b["switching"] is None and b["last_switch"] not in (None, before),
        )
        assert body["last_switch"]["outcome"] == "switched" and body["last_switch"]["to"] == target
    log = proc.log_text()  # the first switch's task ended a whole switch ago
    assert "never retrieved" not in log and "CurrentThreadExecutor" not in log
    assert not [e for e in proc.events() if e.get("event") == "ignis.switch.record_failed"]


def test_a_switch_to_the_serving_model_is_a_no_op_answered_at_once(live):
    """Issue 11 point 11: no reload, the statistics stay, and it is no switch in the history."""
    base, _, _ = live
    wait_status(base, DEFAULT, "serving")
    assert chat(base, DEFAULT).status_code == 200
    before = models(base)["last_switch"]
    finished = httpx.get(base + "/health", timeout=10).json()["engine"]["stats"]["finished"]
    resp = switch(base, model=DEFAULT)
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert (body["status"], body["outcome"], body["to"]) == ("done", "unchanged", DEFAULT)
    assert models(base)["last_switch"] == before and entry(base, DEFAULT)["status"] == "serving"
    assert httpx.get(base + "/health", timeout=10).json()["engine"]["stats"]["finished"] >= finished


@pytest.mark.parametrize("path", ["../outside", "/etc", "escape", "smollm2-135m-instruct/../../outside"])
def test_path_traversal_refused(live, path):
    base, _, _ = live
    assert_openai_error(switch(base, path=path), 400, "invalid_path", "path")
    assert_openai_error(
        httpx.post(base + "/v1/catalog/import", json={"path": path}, timeout=10), 400, "invalid_path", "path"
    )


def test_unknown_model_is_404_and_other_errors(live):
    base, _, _ = live
    assert_openai_error(switch(base, model="no-such-model"), 404, "model_not_found", "model")
    assert_openai_error(chat(base, "no-such-model"), 404, "model_not_found", "model")
    assert_openai_error(switch(base), 400, "missing_required_parameter", "model")
    assert_openai_error(switch(base, model=7), 400, "invalid_type", "model")


def test_no_file_and_wrong_id_are_refused_and_the_old_model_keeps_serving(live):
    base, _, _ = live
    serving = next(m["id"] for m in models(base)["data"] if m["status"] == "serving")
    assert switch(base, path="nothing-here").status_code == 202
    last = wait_last_switch(base, "refused")
    assert "no file" in last["reason"]
    assert switch(base, path=TINY, model="broken-llama").status_code == 202
    last = wait_last_switch(base, "refused")
    assert "belongs to" in last["reason"]
    assert entry(base, serving)["status"] == "serving"


def test_catalog_import_by_celery_then_bad_checksum_is_refused(live):
    base, mdir, _ = live
    shutil.copytree(mdir / TINY, mdir / "tiny-copy")
    resp = httpx.post(base + "/v1/catalog/import", json={"path": "tiny-copy"}, timeout=10)
    assert resp.status_code == 202, resp.text
    art = _wait_catalog(base, "tiny-copy", "on_disk")
    assert art["sha256"] and art["progress"]["percent"] == 100.0 and art["format"] == "hf"
    assert "tiny-copy" in [m["id"] for m in models(base)["data"]]  # on disk in the catalog: servable
    cfg = json.loads((mdir / "tiny-copy" / "config.json").read_text())
    (mdir / "tiny-copy" / "config.json").write_text(json.dumps({**cfg, "note": "tampered"}))
    serving = next(m["id"] for m in models(base)["data"] if m["status"] == "serving")
    assert switch(base, model="tiny-copy").status_code == 202
    last = wait_last_switch(base, "refused")
    assert "checksum" in last["reason"]
    assert entry(base, serving)["status"] == "serving"


def test_failure_after_teardown_restores_and_implicit_failure_is_503_without_retry_after(live):
    base, _, _ = live
    assert chat(base, TINY).status_code == 200  # serving the quick one, so the restore is quick
    assert switch(base, model="broken-llama").status_code == 202
    last = wait_last_switch(base, "restored")
    assert last["to"] == "broken-llama" and last["reason"]
    assert entry(base, TINY)["status"] == "serving"
    resp = chat(base, "broken-llama")
    assert_openai_error(resp, 503, "model_switch_failed")
    assert "retry-after" not in resp.headers
    assert models(base)["last_switch"]["outcome"] == "restored"
    assert entry(base, TINY)["status"] == "serving"


def test_implicit_switching_off_makes_another_name_a_404(live):
    base, _, _ = live
    patch = httpx.patch(base + "/v1/config", json={"switch.allow_implicit": False}, timeout=10)
    assert patch.status_code == 200, patch.text
    try:
        serving = next(m["id"] for m in models(base)["data"] if m["status"] == "serving")
        other = DEFAULT if serving == TINY else TINY
        for _ in range(2):  # alternating names no longer reloads anything
            assert_openai_error(chat(base, other), 404, "model_not_found", "model")
            assert chat(base, serving).status_code == 200
        assert entry(base, serving)["status"] == "serving"
    finally:
        httpx.patch(base + "/v1/config", json={"switch.allow_implicit": True}, timeout=10)


def test_running_request_gets_the_drain_timeout_then_engine_error(live):
    """A stream running when a switch is accepted keeps decoding for the drain timeout; one still
    running then ends with ``engine_error``. The stream is the default model counting greedily to a
    thousand, which outlasts the 2 s drain by far (the tiny model's stream, sampled at temperature 1,
    sometimes finished within it). Which side it landed on is still read from the stream and
    asserted: cut by the switch (one error, last, after the whole drain timeout, with tokens decoded
    during the drain) or finished on its own within the drain (one finish_reason, usage to match)."""
    base, _, _ = live
    assert chat(base, DEFAULT).status_code == 200
    events: list[tuple[float, dict]] = []  # (time.monotonic() received, the data line's JSON)
    streaming = threading.Event()
    body = {
        "model": DEFAULT,
        "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
        "max_tokens": 1900,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }

    def stream():
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append((time.monotonic(), json.loads(line[6:])))
                    streaming.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert streaming.wait(60), "the stream sent nothing"
    t0 = time.monotonic()  # before the engine can accept the switch, so its drain deadline is >= t0 + DRAIN
    assert switch(base, model=TINY).status_code == 202
    t.join(60)
    assert not t.is_alive(), "the stream outlived the switch"
    last = wait_last_switch(base, "switched")
    assert last["from"] == DEFAULT and last["to"] == TINY and last["trigger"] == "explicit"
    errors = [d["error"] for _, d in events if "error" in d]
    finishes = [c["finish_reason"] for _, d in events for c in d.get("choices", []) if c.get("finish_reason")]
    decoded_in_drain = [
        d for ts, d in events if ts > t0 and any(c["delta"].get("content") for c in d.get("choices", []))
    ]
    if errors:  # cut by the switch once the drain timed out
        assert [e["code"] for e in errors] == ["engine_error"] and finishes == [], events[-3:]
        assert "error" in events[-1][1], "the error is the stream's last event"
        assert events[-1][0] - t0 >= DRAIN, "it was given the whole drain timeout"
        assert decoded_in_drain, "it kept decoding while the switch waited"
    else:  # finished on its own before the drain timed out
        assert len(finishes) == 1 and finishes[0] in ("stop", "length"), events[-3:]
        usage = events[-1][1]["usage"]
        assert usage["completion_tokens"] == 1900 if finishes[0] == "length" else usage["completion_tokens"] < 1900
    side = "cut by the switch" if errors else f"finished ({finishes}) before the switch"
    print(f"the stream: {side}, {len(decoded_in_drain)} chunks during the drain")


def _wait_catalog(base: str, served_id: str, state: str, timeout: float = 60.0) -> dict:
    def artifact():
        data = httpx.get(base + "/v1/catalog", timeout=10).json()["data"]
        return next((a for a in data if a["id"] == served_id), None)

    return wait_for(
        artifact,
        timeout,
        0.3,
        f"{served_id} to be {state} in GET /v1/catalog",
        until=lambda a: a and a["state"] == state,
    )
