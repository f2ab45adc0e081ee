"""Scaled mode: two `serve` front ends and one `runengine` on a redis-server this module starts.

A live config change made on one front end reaches the other (the Channels
group every serve joins), and the switch history is recorded whichever front
end -- or none -- asked for the switch.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import sys

import httpx
import pytest

from tests.e2e.server import LiveProcess, free_port, migrate, server_env, start_server
from tests.e2e.switching_helpers import TINY, chat, models
from tests.helpers import wait_for
from tests.models.tiny import models_dir_with_two

pytestmark = pytest.mark.e2e
FLAGS = ("--model-id", TINY, "--model-path", TINY, "--model-idle-unload", "0")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_gguf_path):
    """{"a": url, "b": url, "var": data dir, "redis": url}: both front ends share the data dir and Redis."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    root = tmp_path_factory.mktemp("scaled")
    var = root / "var"
    var.mkdir()
    mdir = models_dir_with_two(root / "models", default_gguf_path, "tiny-b")
    port = free_port()
    redis = LiveProcess(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        server_env(var),
        root / "redis.log",
    )
    redis_url = f"redis://127.0.0.1:{port}/0"
    env_extra = {"IGNIS_SERVER_REDIS_URL": redis_url, "IGNIS_SERVER_MODELS_DIR": str(mdir)}
    env = server_env(var, **env_extra)
    migrate(env)
    procs = [redis, LiveProcess([sys.executable, "manage.py", "runengine", *FLAGS], env, var / "engine.log")]
    try:
        a, url_a = start_server(var, *FLAGS, env_extra=env_extra)
        procs.append(a)
        b, url_b = start_server(var, *FLAGS, env_extra=env_extra)
        procs.append(b)
        yield {"a": url_a, "b": url_b, "var": var, "redis": redis_url, "mdir": mdir}
    finally:
        for proc in reversed(procs):
            proc.stop()


def config(base: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(base + "/v1/config", headers=headers, timeout=10)


def test_a_live_change_on_one_front_end_reaches_the_other(fleet):
    a, b = fleet["a"], fleet["b"]
    resp = httpx.patch(a + "/v1/config", json={"server.deadline": 321, "model.default_max_tokens": 5}, timeout=30)
    assert resp.status_code == 200, resp.text
    wait_for(
        lambda: config(b).json()["values"]["server.deadline"],
        10,
        0.2,
        "B to read server.deadline 321",
        until=lambda v: v == 321.0,
        ignoring=(httpx.HTTPError,),
    )
    assert config(b).json()["values"]["model.default_max_tokens"] == 5
    assert config(b).json()["sources"]["server.deadline"] == "saved"
    # API keys: set on A, enforced by B; cleared on B (with the key), open again on A.
    assert httpx.patch(a + "/v1/config", json={"server.api_keys": "sk-one,sk-two"}, timeout=30).status_code == 200
    wait_for(
        lambda: config(b).status_code,
        10,
        0.2,
        "B to ask for a key",
        until=lambda c: c == 401,
        ignoring=(httpx.HTTPError,),
    )
    assert config(b, "sk-two").status_code == 200
    assert chat(b).status_code == 401
    resp = httpx.patch(
        b + "/v1/config", json={"server.api_keys": ""}, headers={"Authorization": "Bearer sk-one"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    wait_for(
        lambda: config(a).status_code, 10, 0.2, "A to open again", until=lambda c: c == 200, ignoring=(httpx.HTTPError,)
    )
    out = chat(a, max_tokens=None)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 5


def switch_rows(var) -> dict[str, tuple]:
    with sqlite3.connect(var / "ignis.sqlite3") as db:
        rows = db.execute("SELECT switch_id, trigger, from_id, to_id, outcome FROM ignis_models_switchrecord")
        return {r[0]: r[1:] for r in rows.fetchall()}


def test_every_finished_switch_is_recorded_once_whoever_asked(fleet):
    """A switch whose asker is gone (sent straight to the engine, no reply channel) is recorded by the
    front end that reads the engine's status first; one a front end asked for is recorded once."""
    from channels_redis.core import RedisChannelLayer

    from engine.messages import ENGINE_CHANNEL, SwitchModel

    orphan = SwitchModel(switch_id="switch-orphan-0001", served_id="tiny-b", path=str(fleet["mdir"] / "tiny-b"))

    async def send():
        layer = RedisChannelLayer(hosts=[fleet["redis"]])
        await layer.send(ENGINE_CHANNEL, orphan.to_message())
        await layer.close_pools()

    asyncio.run(send())
    last = wait_for(
        lambda: models(fleet["b"])["last_switch"],
        60,
        0.2,
        "B to report the orphan switch to tiny-b",
        until=lambda m: m and m["to"] == "tiny-b",
        ignoring=(httpx.HTTPError,),
    )
    assert last["outcome"] == "switched"
    assert switch_rows(fleet["var"])["switch-orphan-0001"] == ("explicit", TINY, "tiny-b", "switched")

    resp = httpx.post(fleet["a"] + "/v1/models/switch", json={"model": TINY}, timeout=30)
    assert resp.status_code == 202, resp.text
    asked = resp.json()["id"]
    wait_for(
        lambda: models(fleet["b"])["last_switch"],
        60,
        0.2,
        f"B to report the switch back to {TINY}",
        until=lambda m: m and m["to"] == TINY,
        ignoring=(httpx.HTTPError,),
    )
    wait_for(
        lambda: switch_rows(fleet["var"]).get(asked),
        10,
        0.2,
        f"the switch {asked} to be recorded",
        until=lambda row: row == ("explicit", "tiny-b", TINY, "switched"),
        ignoring=(sqlite3.OperationalError,),
    )
    models(fleet["a"])
    assert sorted(switch_rows(fleet["var"])) == sorted(["switch-orphan-0001", asked])


def test_front_ends_start_no_celery_worker_with_redis(fleet):
    logs = [p.read_text(errors="replace") for p in fleet["var"].glob("server-*.log")]
    assert len(logs) == 2 and all("ignis serving" in text for text in logs)
    assert not any("ignis-embedded" in text for text in logs)  # a dedicated `celery -A ignis_site worker` runs them
    assert config(fleet["a"]).json()["values"]["server.celery_worker"] is False
