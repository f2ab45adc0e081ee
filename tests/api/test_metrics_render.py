"""Rendering an engine status reply as Prometheus families, and the Monitor's route."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from apps.core.metrics import engine_families, engine_samples, is_loopback, parse_bind
from engine.status import EngineStatus

STATUS = {
    "status": "serving",
    "model": "m",
    "backend": "numpy",
    "max_context": 2048,
    "switch_outcomes": {"switched": 1, "refused": 1},
    "stats": {
        "admitted": 4,
        "finished": 3,
        "decoded_tokens": 50,
        "prefilled_tokens": 80,
        "lanes_total": 4,
        "lanes_busy": 1,
        "lanes_decoding": 1,
        "prefix_hits": 2,
        "cached_tokens": 32,
        "round_seconds": 0.05,
        "kv_pages": {
            "total": 100,
            "used": 5,
            "retained": 10,
            "pinned": 1,
            "free": 85,
            "host_total": 50,
            "host_used": 3,
        },
    },
    "lanes": {
        "lanes": [
            {
                "seq_id": 7,
                "class": "agent",
                "state": "decoding",
                "tokens_per_second": 12.5,
                "output_tokens": 3,
                "max_tokens": 9,
            }
        ],
        "prefill": None,
        "requests_by_state_class": {"decoding": {"agent": 1}},
    },
    "plan": {
        "budget_bytes": 10,
        "weights_bytes": 6,
        "workspace_bytes": 1,
        "kv_bytes": 3,
        "host_kv_bytes": 4,
        "block_size": 16,
        "num_blocks": 100,
        "num_host_blocks": 50,
    },
    "telemetry": {
        "ttft_seconds": {"bounds": [0.1, 1.0], "cumulative": [1, 2, 3], "sum": 2.5, "count": 3},
        "finish_reasons": {"stop": 2, "length": 1},
        "model_events": {"switch": 2},
    },
}


class _Static:
    def __init__(self, status):
        self.status = status

    def collect(self):
        return engine_families(self.status)


def _parse(status) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(status))
    text = generate_latest(registry).decode()
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_a_status_reply_renders_every_family():
    v = _parse(EngineStatus.from_message(STATUS))
    assert v["ignis_engine_up[]"] == 1
    assert v["ignis_model_status[('model', 'm'), ('status', 'serving')]"] == 1
    assert v["ignis_model_status[('model', 'm'), ('status', 'loading')]"] == 0
    assert v["ignis_model_switches_total[('outcome', 'switched')]"] == 1
    assert v["ignis_model_switches_total[('outcome', 'refused')]"] == 1
    assert v["ignis_model_switches_total[('outcome', 'failed')]"] == 0
    assert v["ignis_decoded_tokens_total[]"] == 50
    assert v["ignis_scheduler_requests[('class', 'agent'), ('state', 'decoding')]"] == 1
    assert v["ignis_scheduler_requests[('class', 'interactive'), ('state', 'waiting')]"] == 0
    assert v["ignis_lane_tokens_per_second[('lane', '0')]"] == 12.5
    assert v["ignis_lane_tokens_per_second[('lane', '3')]"] == 0
    assert v["ignis_kv_pages[('state', 'retained')]"] == 10
    assert v["ignis_kv_pages_on_host[]"] == 3
    assert v["ignis_memory_plan_bytes[('part', 'weights')]"] == 6
    assert v["ignis_request_ttft_seconds_bucket[('le', '1.0')]"] == 2
    assert v["ignis_request_ttft_seconds_bucket[('le', '+Inf')]"] == 3
    assert v["ignis_request_ttft_seconds_count[]"] == 3
    assert v["ignis_requests_completed_total[('reason', 'stop')]"] == 2
    assert v["ignis_prefix_cached_tokens_total[]"] == 32


def test_no_engine_reads_zero_not_missing():
    v = _parse(None)
    assert v["ignis_engine_up[]"] == 0
    assert v["ignis_memory_plan_bytes[('part', 'kv')]"] == 0
    assert v["ignis_kv_pool_pages[]"] == 0
    assert v["ignis_request_e2e_seconds_count[]"] == 0


def test_samples_flatten_with_labels():
    flat = engine_samples(EngineStatus.from_message(STATUS))
    assert flat["ignis_lanes_busy"] == 1
    assert flat['ignis_kv_pages{state="used"}'] == 5


def test_bind_parsing():
    assert parse_bind("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    assert parse_bind("") is None and parse_bind("off") is None
    with pytest.raises(ValueError):
        parse_bind("nonsense")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_monitor_route(client, monkeypatch, settings):
    from apps.core import engine_client

    async def fake_status(timeout: float = 2.0):
        return EngineStatus.from_message(STATUS)

    monkeypatch.setattr(engine_client, "engine_status", fake_status)
    data = client.get("/ui/api/monitor").json()
    assert data["status"] == "serving" and data["lanes"][0]["state"] == "decoding"
    assert data["metrics"]["ignis_decoded_tokens_total"] == 50
    assert client.get("/ui/").status_code == 200
    assert client.get("/ui/static/app.js").status_code == 200

    # Keys are the ASGI gate's (apps/api/auth.py, tests/api/test_auth.py), which the test client
    # bypasses: the view has no check of its own to disagree with it.
    monkeypatch.setitem(settings.IGNIS, "server.api_keys", "k1,k2")
    assert client.get("/ui/api/monitor").status_code == 200


def test_the_expert_cache_counters_render_from_backend_stats():
    experts = {"resident": 24, "total": 48, "hits": 90, "misses": 10, "bytes_moved": 4096}
    v = _parse(EngineStatus.from_message({**STATUS, "backend_stats": {"experts": experts}}))
    assert v["ignis_expert_cache_hits_total[]"] == 90
    assert v["ignis_expert_cache_misses_total[]"] == 10
    assert v["ignis_expert_cache_moved_bytes_total[]"] == 4096
    assert v["ignis_experts_resident[]"] == 24
    assert _parse(EngineStatus.from_message(STATUS))["ignis_expert_cache_hits_total[]"] == 0  # a dense model
