"""Unit tests for the catalog's rules: config validation, path confinement, the RAM plan."""

from __future__ import annotations

import os

import pytest

from engine.memory import ram_plan, weights_bytes
from engine.model_config import ModelConfig
from engine.switching import SwitchRefused, planned_ram
from ignis_site import config

SMOL = ModelConfig(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position=8192,
    tie_word_embeddings=True,
)


def test_validate_names_the_bad_key_and_parses_the_rest():
    assert config.validate({"model.decode_share": "0.5", "switch.allow_implicit": "off"}) == {
        "model.decode_share": 0.5,
        "switch.allow_implicit": False,
    }
    for patch, key in [
        ({"model.decode_share": 1.5}, "model.decode_share"),
        ({"x.y": 1}, "x.y"),
        ({"model.idle_unload": 2.5}, "model.idle_unload"),
    ]:
        with pytest.raises(ValueError) as exc:
            config.validate(patch)
        assert exc.value.args[0] == key


def test_key_applies():
    assert config.key_applies("model.max_context") == "reload"
    assert config.key_applies("model.idle_unload") == "live"
    assert config.key_applies("server.port") == "restart"


def test_weights_estimate_matches_the_numpy_backend():
    assert weights_bytes(SMOL) == 651306240  # what ignis.runtime.vram_plan logs for SmolLM2-135M


def test_ram_plan_refuses_with_bytes():
    plan = ram_plan(SMOL, ram_budget=0, kv_ram_budget=1 << 29, max_context=8192, block_size=16, freed_bytes=0)
    assert plan.kv_bytes == 1 << 29 and plan.problem is None
    assert plan.workspace_bytes == 8 * 4 * (49152 + 4 * 1536 + 4 * 576)  # the one workspace formula
    tight = dict(ram_budget=700_000_000, kv_ram_budget=0, max_context=8192, block_size=16, freed_bytes=0)
    assert "budget_bytes=700000000" in ram_plan(SMOL, **tight).problem
    with pytest.raises(SwitchRefused, match="budget_bytes=700000000"):
        planned_ram(SMOL, **tight)  # what a switch's precheck and a numpy load raise
    assert planned_ram(SMOL, ram_budget=0, kv_ram_budget=1 << 29, max_context=8192, block_size=16, freed_bytes=0)


def test_ram_plan_refuses_what_the_host_cannot_hold(monkeypatch):
    from engine import memory

    monkeypatch.setattr(memory, "mem_available", lambda: 100_000_000)
    plan = ram_plan(SMOL, ram_budget=0, kv_ram_budget=1 << 29, max_context=8192, block_size=16, freed_bytes=0)
    assert "exceed available_bytes=100000000" in plan.problem
    freed = ram_plan(SMOL, ram_budget=0, kv_ram_budget=1 << 29, max_context=8192, block_size=16, freed_bytes=1 << 30)
    assert freed.problem is None  # what the old model frees at teardown counts


@pytest.mark.django_db
def test_path_confine_refuses_escapes(tmp_path, settings):
    from apps.core.errors import InvalidRequest
    from apps.models.services import path_confine

    settings.MODELS_DIR = tmp_path / "models"
    (tmp_path / "models" / "ok").mkdir(parents=True)
    os.symlink(tmp_path, tmp_path / "models" / "escape")
    assert path_confine("ok") == (tmp_path / "models" / "ok").resolve()
    for raw in ("../x", "/etc/passwd", "escape", "ok/../../x"):
        with pytest.raises(InvalidRequest):
            path_confine(raw)


def test_resolve_orders_defaults_saved_env_flags():
    saved = {"server.deadline": 5, "model.idle_unload": 7, "server.data_dir": "/elsewhere", "server.port": "bad"}
    env = {"IGNIS_MODEL_IDLE_UNLOAD": "8", "IGNIS_SWITCH_DRAIN_TIMEOUT": "3"}
    values, sources = config.resolve({"switch.drain_timeout": "4"}, environ=env, saved=saved)
    assert (values["server.deadline"], sources["server.deadline"]) == (5.0, "saved")
    assert (values["model.idle_unload"], sources["model.idle_unload"]) == (8, "env")
    assert (values["switch.drain_timeout"], sources["switch.drain_timeout"]) == (4.0, "flag")
    assert sources["server.data_dir"] == "default"  # start-only: never read from the database
    assert (values["server.port"], sources["server.port"]) == (8080, "default")  # a bad saved value is skipped


def test_celery_worker_defaults_off_in_scaled_mode():
    assert config.resolve(environ={})[0]["server.celery_worker"] is True
    scaled = {"IGNIS_SERVER_REDIS_URL": "redis://127.0.0.1:6379/0"}
    assert config.resolve(environ=scaled)[0]["server.celery_worker"] is False
    assert config.resolve(environ={**scaled, "IGNIS_SERVER_CELERY_WORKER": "1"})[0]["server.celery_worker"] is True
    assert config.resolve(environ=scaled, saved={"server.celery_worker": True})[0]["server.celery_worker"] is True
