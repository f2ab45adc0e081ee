"""The engine's status reply as the Django side reads it: ``EngineStatus.from_message``
over the dict the engine sends, the client that asks for it, and the readers
(GET /health, GET /v1/models, the switch gate) that render or act on it."""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import fields

import pytest
from channels.layers import InMemoryChannelLayer

from apps.core import engine_client
from apps.core.errors import ModelSwitching
from engine.messages import ENGINE_CHANNEL
from engine.status import EngineState, EngineStatus, SchedulerStats


def _histogram(bounds: list[float], cumulative: list[int], total: float) -> dict:
    return {"bounds": bounds, "cumulative": cumulative, "sum": total, "count": cumulative[-1]}


# The keys (and their order) of engine/worker.py's EngineWorker.status_message(),
# captured from a worker holding a scheduler with two agent requests decoding.
SERVING = {
    "type": "engine.status",
    "status": "serving",
    "model": "m",
    "error": None,
    "backend": "numpy",
    "max_context": 8192,
    "path": "/models/m/m.gguf",
    "switching": None,
    "last_switch": {"switch_id": "switch-1", "from": "a", "to": "m", "outcome": "switched", "seconds": 1.5},
    "recent_switches": [
        {
            "switch_id": "switch-1",
            "trigger": "explicit",
            "from": "a",
            "to": "m",
            "outcome": "switched",
            "reason": "",
            "seconds": 1.5,
            "at": 1700000000.0,
        }
    ],
    "switch_outcomes": {"switched": 1},
    "load_progress": None,
    "idle_unload": 300.0,
    "idle_seconds": 0.25,
    "stats": {
        "requests_by_state": {"decoding": 2},
        "requests_by_class": {"agent": 2},
        "lanes_total": 4,
        "lanes_busy": 2,
        "lanes_decoding": 2,
        "kv_pages": {"total": 64, "used": 8, "retained": 3, "pinned": 1, "free": 53, "host_total": 32, "host_used": 2},
        "prefix_hits": 1,
        "cached_tokens": 16,
        "round_seconds": 0.02,
        "admitted": 2,
        "refused": 1,
        "finished": 5,
        "aborted": 1,
        "preempted": 0,
        "recomputed": 0,
        "decoded_tokens": 11,
        "prefilled_tokens": 20,
        "decode_rounds": 5,
        "prefill_chunks": 2,
        "spec_trimmed": 3,
        "spec_drafted": {"prompt_lookup": 6},
        "spec_accepted": {"prompt_lookup": 4},
        "loop_guard_fired": {"loop": 1},
        "loop_guard_taken_back": 18,
    },
    "lanes": {
        "lanes": [
            {
                "seq_id": 0,
                "class": "agent",
                "state": "decoding",
                "prompt_tokens": 10,
                "computed_tokens": 15,
                "cached_tokens": 0,
                "output_tokens": 6,
                "max_tokens": 8,
                "tokens_per_second": 40.0,
            },
            {
                "seq_id": 1,
                "class": "agent",
                "state": "decoding",
                "prompt_tokens": 10,
                "computed_tokens": 14,
                "cached_tokens": 0,
                "output_tokens": 5,
                "max_tokens": 8,
                "tokens_per_second": 38.5,
            },
        ],
        "prefill": None,
        "requests_by_state_class": {"decoding": {"agent": 2}},
    },
    "plan": {
        "budget_bytes": 1000,
        "weights_bytes": 600,
        "workspace_bytes": 100,
        "kv_bytes": 300,
        "block_size": 16,
        "num_blocks": 64,
        "host_kv_bytes": 150,
        "num_host_blocks": 32,
    },
    "telemetry": {
        "ttft_seconds": _histogram([0.01, 0.1], [1, 2, 2], 0.12),
        "inter_token_seconds": _histogram([0.001, 0.01], [0, 9, 9], 0.05),
        "e2e_seconds": _histogram([0.1, 1.0], [0, 2, 2], 0.9),
        "finish_reasons": {"stop": 1, "length": 1},
        "model_events": {"loaded": 1},
        "completion_tokens": 11,
    },
    "backend_stats": {"experts": {"resident": 24, "total": 48, "hits": 9, "misses": 1, "bytes_moved": 512}},
}

# Nothing loaded yet: no scheduler, so no "stats" and no "lanes"; the plan reads zero.
LOADING = {
    **{k: v for k, v in SERVING.items() if k not in ("stats", "lanes")},
    "status": "loading",
    "last_switch": None,
    "recent_switches": [],
    "switch_outcomes": {},
    "load_progress": {"done": 3, "total": 30, "unit": "tensors"},
    "plan": dict.fromkeys(SERVING["plan"], 0),
}


def test_from_message_reads_what_the_readers_use():
    status = EngineStatus.from_message(copy.deepcopy(SERVING))
    assert status.status is EngineState.SERVING
    assert (status.model, status.path, status.backend, status.max_context) == ("m", "/models/m/m.gguf", "numpy", 8192)
    assert isinstance(status.stats, SchedulerStats)
    assert (status.stats.lanes_total, status.stats.lanes_busy, status.stats.lanes_decoding) == (4, 2, 2)
    assert status.stats.kv_pages["used"] == 8 and status.stats.kv_pages["host_used"] == 2
    assert (status.stats.refused, status.stats.decoded_tokens, status.stats.prefill_chunks) == (1, 11, 2)
    assert status.stats.round_seconds == 0.02
    assert status.lanes["lanes"][1]["tokens_per_second"] == 38.5
    assert status.plan["block_size"] == 16 and status.plan["host_kv_bytes"] == 150
    assert status.telemetry["finish_reasons"] == {"stop": 1, "length": 1}
    assert status.recent_switches[0]["switch_id"] == "switch-1"
    assert status.switch_outcomes == {"switched": 1} and status.idle_unload == 300.0


def test_every_scheduler_stat_the_engine_sends_has_a_field():
    # from_message drops keys SchedulerStats does not name: a stat added on one side only would vanish.
    assert list(SERVING["stats"]) == [f.name for f in fields(SchedulerStats)]


def test_from_message_while_nothing_is_loaded():
    status = EngineStatus.from_message(copy.deepcopy(LOADING))
    assert status.status is EngineState.LOADING
    assert status.stats is None and status.lanes is None
    assert status.load_progress == {"done": 3, "total": 30, "unit": "tensors"}
    assert not any(status.plan.values())


@pytest.mark.parametrize("msg", [SERVING, LOADING], ids=["serving", "loading"])
def test_payload_is_the_message_the_engine_sent(msg):
    payload = engine_client.engine_status_payload(EngineStatus.from_message(copy.deepcopy(msg)))
    assert json.dumps(payload) == json.dumps(msg)  # same keys, same order, same values
    assert engine_client.engine_status_payload(None) is None


def test_engine_status_asks_over_the_layer(monkeypatch):
    layer = InMemoryChannelLayer()
    monkeypatch.setattr(engine_client, "get_channel_layer", lambda: layer)

    async def engine_once():
        ask = await layer.receive(ENGINE_CHANNEL)
        assert ask["type"] == "engine.status"
        await layer.send(ask["reply_channel"], copy.deepcopy(SERVING))

    async def main():
        engine = asyncio.ensure_future(engine_once())
        answered = await engine_client.engine_status(timeout=5)
        await engine
        silent = await engine_client.engine_status(timeout=0.05)  # nobody answers this one
        return answered, silent

    answered, silent = asyncio.run(main())
    assert isinstance(answered, EngineStatus) and answered.status is EngineState.SERVING
    assert answered.stats.lanes_busy == 2
    assert silent is None


def _fake_status(monkeypatch, msg: dict | None) -> None:
    async def fake(timeout: float = 2.0):
        return None if msg is None else EngineStatus.from_message(copy.deepcopy(msg))

    monkeypatch.setattr(engine_client, "engine_status", fake)


@pytest.mark.parametrize(
    ("msg", "code", "state"), [(SERVING, 200, "ok"), (LOADING, 503, "loading"), (None, 503, "unreachable")]
)
def test_health_renders_the_engine_reply_as_sent(client, monkeypatch, msg, code, state):
    _fake_status(monkeypatch, msg)
    resp = client.get("/health")
    assert resp.status_code == code
    body = resp.json()
    assert body["status"] == state
    assert body["engine"] == msg
    if msg is LOADING:
        assert "stats" not in body["engine"]


def test_health_is_ok_while_unloaded(client, monkeypatch):
    _fake_status(monkeypatch, {**LOADING, "status": "unloaded", "load_progress": None})
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_models_payload_carries_the_engine_state(monkeypatch):
    from apps.api import model_views
    from apps.models.services import served_model

    served_id = served_model().served_id
    failed = {**LOADING, "status": "failed", "error": "out of memory", "load_progress": None, "model": served_id}

    async def status_sync():
        return EngineStatus.from_message(copy.deepcopy(failed))

    monkeypatch.setattr(model_views, "status_sync", status_sync)
    monkeypatch.setattr(
        model_views.selectors,
        "servable_list",
        lambda: [{"id": served_id, "artifact": "m.gguf"}, {"id": "other", "artifact": "o.gguf"}],
    )
    body = asyncio.run(model_views.models_payload())
    mine, other = body["data"]
    assert json.loads(json.dumps(mine)) == {
        "id": served_id,
        "object": "model",
        "created": 0,
        "owned_by": "ignis",
        "artifact": "m.gguf",
        "status": "failed",
        "switching": None,
        "last_switch": None,
        "error": "out of memory",
        "max_model_len": 8192,
    }
    assert other["status"] == "unloaded" and "error" not in other
    assert body["switching"] is None and body["last_switch"] is None


def test_models_payload_without_an_engine_reads_loading(monkeypatch):
    from apps.api import model_views

    async def status_sync():
        return None

    monkeypatch.setattr(model_views, "status_sync", status_sync)
    monkeypatch.setattr(model_views.selectors, "servable_list", lambda: [{"id": "other", "artifact": "o.gguf"}])
    monkeypatch.setattr(model_views, "served_model", lambda: type("Served", (), {"served_id": "other"})())
    (entry,) = asyncio.run(model_views.models_payload())["data"]
    assert entry["status"] == "loading" and "max_model_len" not in entry and "load_progress" not in entry


@pytest.mark.parametrize(("state", "refused"), [("switching", True), ("serving", False), ("loading", False)])
def test_switch_gate_refuses_only_while_switching(monkeypatch, state, refused):
    import time

    from apps.core import engine_state
    from apps.models import switching
    from engine.messages import EngineHeartbeat

    async def no_round_trip(timeout: float = 2.0):
        raise AssertionError("the gate reads the pushed status")

    monkeypatch.setattr(engine_client, "engine_status_ask", no_round_trip)
    cache = engine_state.EngineStateCache()
    cache.listening = True
    cache.take(EngineHeartbeat("e1", 1.0, {**SERVING, "status": state, "recent_switches": []}), time.monotonic())
    monkeypatch.setattr(engine_state, "CACHE", cache)
    gate = switching.switch_gate(method="POST", path="/v1/chat/completions")
    if refused:
        with pytest.raises(ModelSwitching) as err:
            asyncio.run(gate)
        assert err.value.retry_after == switching.SWITCH_RETRY_AFTER
    else:
        asyncio.run(gate)


def test_monitor_without_an_engine_reads_unreachable(client, monkeypatch):
    _fake_status(monkeypatch, None)
    data = client.get("/ui/api/monitor").json()
    assert (data["status"], data["model"], data["backend"], data["error"]) == ("unreachable", None, None, None)
    assert data["lanes"] == [] and data["prefill"] is None
    assert data["metrics"]["ignis_engine_up"] == 0 and data["metrics"]["ignis_lanes_busy"] == 0
