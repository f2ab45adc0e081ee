"""GET/PATCH /v1/config on a live server serving the tiny checkpoint."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest

from tests.e2e.server import start_server
from tests.e2e.switching_helpers import TINY, chat, entry, models
from tests.helpers import assert_openai_error
from tests.models.tiny import models_dir_with_two

pytestmark = pytest.mark.e2e


FLAGS = ("--model-id", TINY, "--model-path", TINY, "--model-idle-unload", "0")


@pytest.fixture(scope="module")
def srv(tmp_path_factory, default_gguf_path):
    """The module's server; the restart test (last) replaces it with one on the same data dir."""
    root = tmp_path_factory.mktemp("config")
    mdir = models_dir_with_two(root / "models", default_gguf_path)
    env = {"IGNIS_SERVER_MODELS_DIR": str(mdir)}
    proc, url = start_server(root / "var", *FLAGS, env_extra=env)
    state = {"proc": proc, "url": url, "var": root / "var", "env": env}
    yield state
    state["proc"].stop()


@pytest.fixture(scope="module")
def base(srv):
    return srv["url"]


def config(base: str) -> dict:
    return httpx.get(base + "/v1/config", timeout=10).json()


def patch(base: str, body: dict) -> httpx.Response:
    return httpx.patch(base + "/v1/config", json=body, timeout=120)


def test_get_lists_every_key_with_how_it_applies(base):
    body = config(base)
    assert body["values"]["model.id"] == TINY
    assert body["values"]["model.idle_unload"] == 0
    assert body["fields"]["model.max_context"]["applies"] == "reload"
    assert body["fields"]["model.decode_share"]["applies"] == "live"
    assert body["fields"]["switch.drain_timeout"]["default"] == 30.0
    assert body["fields"]["switch.allow_implicit"]["default"] is True


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model.decode_share": 2}, "model.decode_share"),
        ({"model.prefill_chunk": "lots"}, "model.prefill_chunk"),
        ({"model.default_max_tokens": 4, "model.idle_unload": -1}, "model.idle_unload"),
        ({"no.such_key": 1}, "no.such_key"),
        ({"switch.allow_implicit": "maybe"}, "switch.allow_implicit"),
        ({"server.data_dir": "/tmp"}, "server.data_dir"),  # read before the database opens
    ],
)
def test_invalid_value_is_400_naming_the_field_and_nothing_changes(base, body, param):
    before = config(base)["values"]
    assert_openai_error(patch(base, body), 400, "invalid_value", param)
    assert config(base)["values"] == before


def test_live_fields_apply_at_once(base):
    resp = patch(base, {"model.default_max_tokens": 3, "model.decode_share": 0.5})
    assert resp.status_code == 200, resp.text
    assert resp.json()["reload"] is None
    assert config(base)["values"]["model.default_max_tokens"] == 3
    out = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0},
        timeout=60,
    )
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 3
    assert patch(base, {"model.default_max_tokens": 1024}).status_code == 200


def test_a_load_field_reloads_the_model_with_the_patch(base):
    resp = patch(base, {"model.max_context": 1024, "model.decode_share": 0.3})
    assert resp.status_code == 200, resp.text
    assert resp.json()["reload"]["outcome"] == "switched"
    assert entry(base, TINY)["max_model_len"] == 1024
    assert models(base)["last_switch"]["trigger"] == "config"
    assert config(base)["values"]["model.max_context"] == 1024
    assert chat(base).status_code == 200


def test_a_plan_that_does_not_fit_is_refused_with_its_bytes_and_nothing_changes(base):
    resp = patch(base, {"model.ram_budget": 4_000_000})
    err = assert_openai_error(resp, 503, "model_switch_failed")
    assert "bytes" in err["message"]
    last = models(base)["last_switch"]
    assert last["outcome"] == "refused" and "budget_bytes=4000000" in last["reason"]
    assert config(base)["values"]["model.ram_budget"] == 0
    assert entry(base, TINY)["status"] == "serving"
    assert chat(base).status_code == 200


def test_a_draft_model_outside_the_models_directory_is_refused(base):
    before = config(base)["values"]
    assert_openai_error(patch(base, {"spec.draft_model": "../../etc"}), 400, "invalid_path", "spec.draft_model")
    assert config(base)["values"] == before


def test_saved_values_are_read_back_at_start_below_env_and_flags(srv):
    """defaults < saved (PATCH / admin) < environment < flags, on a restart over the same data dir."""
    resp = patch(srv["url"], {"server.deadline": 123, "switch.drain_timeout": 7})
    assert resp.status_code == 200, resp.text
    assert resp.json()["overridden_at_start"] == []
    assert config(srv["url"])["sources"]["server.deadline"] == "saved"
    srv["proc"].stop()
    srv["proc"], srv["url"] = start_server(
        srv["var"], *FLAGS, "--switch-drain-timeout", "9", env_extra={**srv["env"], "IGNIS_SERVER_DEADLINE_MAX": "99"}
    )
    body = config(srv["url"])
    assert body["values"]["server.deadline"] == 123.0 and body["sources"]["server.deadline"] == "saved"
    assert body["values"]["model.max_context"] == 1024  # saved by the reload test above
    assert body["values"]["switch.drain_timeout"] == 9.0 and body["sources"]["switch.drain_timeout"] == "flag"
    assert body["values"]["model.idle_unload"] == 0 and body["sources"]["model.idle_unload"] == "flag"
    assert body["sources"]["server.deadline_max"] == "env"
    with sqlite3.connect(srv["var"] / "ignis.sqlite3") as db:  # the flag won; the saved value stays saved
        row = db.execute("SELECT value, saved FROM ignis_models_configvalue WHERE key = 'switch.drain_timeout'")
        value, saved = row.fetchone()
    assert json.loads(value) == 7 and saved == 1
    resp = patch(srv["url"], {"switch.drain_timeout": 8})
    assert resp.json()["overridden_at_start"] == ["switch.drain_timeout"]
    assert chat(srv["url"]).status_code == 200
