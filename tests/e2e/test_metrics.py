"""/metrics on its own loopback listener: the families, their movement under
load, the JSON log of a request's life, and the same numbers in Redis mode."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import LiveProcess, free_port, migrate, server_env, start_server, wait_healthy
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

FAMILIES = {
    "ignis_engine_up": "gauge",
    "ignis_model_status": "gauge",
    "ignis_model_info": "gauge",
    "ignis_model_switches": "counter",
    "ignis_scheduler_requests": "gauge",
    "ignis_requests_admitted": "counter",
    "ignis_requests_finished": "counter",
    "ignis_decoded_tokens": "counter",
    "ignis_prefilled_tokens": "counter",
    "ignis_request_ttft_seconds": "histogram",
    "ignis_request_inter_token_seconds": "histogram",
    "ignis_request_e2e_seconds": "histogram",
    "ignis_lanes_total": "gauge",
    "ignis_lanes_busy": "gauge",
    "ignis_lane_tokens_per_second": "gauge",
    "ignis_prefill_tokens": "gauge",
    "ignis_kv_pool_pages": "gauge",
    "ignis_kv_pages": "gauge",
    "ignis_kv_pages_on_host": "gauge",
    "ignis_prefix_cache_hits": "counter",
    "ignis_prefix_cached_tokens": "counter",
    "ignis_memory_plan_bytes": "gauge",
}
MODEL = "smollm2-135m-instruct"


class Scrape:
    def __init__(self, url: str):
        resp = httpx.get(url, timeout=10)
        assert resp.status_code == 200, resp.text
        self.families = {f.name: f for f in text_string_to_metric_families(resp.text)}

    def value(self, name: str, **labels: str) -> float:
        """One sample by full name (``ignis_decoded_tokens_total``) and labels."""
        for fam in self.families.values():
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise KeyError(f"{name} {labels}")

    def total(self, name: str) -> float:
        return sum(s.value for fam in self.families.values() for s in fam.samples if s.name == name)


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_gguf_path):
    metrics_port = free_port()
    proc, base = start_server(
        tmp_path_factory.mktemp("metrics"),
        "--model-idle-unload",
        "0",
        "--server-metrics-bind",
        f"127.0.0.1:{metrics_port}",
    )
    yield proc, base, f"http://127.0.0.1:{metrics_port}/metrics"
    proc.stop()


def _chat(base: str, content: str, max_tokens: int, results: list) -> None:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=180)
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": content}],
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
    results.append(usage)


def test_families_on_the_loopback_listener_only(served):
    proc, base, metrics_url = served
    scrape = Scrape(metrics_url)
    for name, kind in FAMILIES.items():
        assert name in scrape.families, name
        assert scrape.families[name].type == kind, name
    assert any(n.startswith("django_http_") for n in scrape.families), "django-prometheus metrics beside ours"
    assert scrape.value("ignis_engine_up") == 1
    assert scrape.value("ignis_model_status", status="serving") == 1
    assert scrape.value("ignis_memory_plan_bytes", part="weights") > 0
    assert scrape.value("ignis_kv_pool_pages") > 0
    assert scrape.value("ignis_lanes_total") >= 3
    # Never on the public port.
    assert httpx.get(base + "/metrics", timeout=10).status_code == 404
    assert '"ignis.metrics.listening"' in proc.log_text()


def test_metrics_move_under_load(served):
    _, base, metrics_url = served
    before = Scrape(metrics_url)
    results: list = []
    threads = [
        # 48 tokens each: long enough that the three overlap for many scrapes on a fast backend too.
        threading.Thread(target=_chat, args=(base, f"Tell me a story about the number {i}.", 48, results))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    max_busy = 0
    while any(t.is_alive() for t in threads):
        during = Scrape(metrics_url)
        max_busy = max(max_busy, during.value("ignis_lanes_busy"))
        time.sleep(0.05)
    for t in threads:
        t.join()
    after = Scrape(metrics_url)
    assert len(results) == 3 and all(u is not None for u in results)
    completion = sum(u.completion_tokens for u in results)
    prompt = sum(u.prompt_tokens - (u.prompt_tokens_details.cached_tokens or 0) for u in results)

    assert max_busy == 3, "three requests at once hold three lanes"
    delta = lambda name, **kw: after.value(name, **kw) - before.value(name, **kw)  # noqa: E731
    assert delta("ignis_requests_admitted_total") == 3
    assert delta("ignis_requests_finished_total") == 3
    assert delta("ignis_decoded_tokens_total") == completion
    assert delta("ignis_prefilled_tokens_total") >= prompt > 0
    assert delta("ignis_request_ttft_seconds_count") == 3
    assert delta("ignis_request_e2e_seconds_count") == 3
    assert delta("ignis_request_inter_token_seconds_count") == completion - 3
    assert delta("ignis_request_ttft_seconds_bucket", le="+Inf") == 3
    assert after.value("ignis_request_e2e_seconds_sum") > before.value("ignis_request_e2e_seconds_sum")
    assert (
        delta("ignis_requests_completed_total", reason="length")
        + delta("ignis_requests_completed_total", reason="stop")
        == 3
    )
    # All done: nothing live, the prompts' pages retained for reuse.
    assert after.total("ignis_scheduler_requests") == 0
    assert after.value("ignis_lanes_busy") == 0
    assert after.value("ignis_kv_pages", state="used") == 0
    assert after.value("ignis_kv_pages", state="retained") > 0
    assert sum(after.value("ignis_kv_pages", state=s) for s in ("used", "retained", "free")) == after.value(
        "ignis_kv_pool_pages"
    )


def test_prompt_reuse_counts(served):
    _, base, metrics_url = served
    before = Scrape(metrics_url)
    content = "Reuse me. " * 40  # several full pages of prompt
    for _ in range(2):
        _chat(base, content, 2, [])
    after = Scrape(metrics_url)
    assert after.value("ignis_prefix_cache_hits_total") > before.value("ignis_prefix_cache_hits_total")
    assert after.value("ignis_prefix_cached_tokens_total") > before.value("ignis_prefix_cached_tokens_total")


def test_monitor_route_reads_the_same_numbers(served):
    _, base, metrics_url = served
    monitor = httpx.get(base + "/ui/api/monitor", timeout=10).json()
    scrape = Scrape(metrics_url)
    m = monitor["metrics"]
    assert monitor["status"] == "serving"
    for key in (
        "ignis_decoded_tokens_total",
        "ignis_kv_pool_pages",
        "ignis_lanes_total",
        "ignis_request_ttft_seconds_count",
        "ignis_prefix_cache_hits_total",
    ):
        assert m[key] == scrape.value(key), key
    assert m['ignis_kv_pages{state="retained"}'] == scrape.value("ignis_kv_pages", state="retained")


def test_the_log_tells_a_requests_life(served):
    proc, base, _ = served
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    events = wait_for(
        proc.events,
        10,
        0.1,
        f"{resp.id}'s ignis.request.done in the log",
        until=lambda evs: any(e.get("request_id") == resp.id and e["event"] == "ignis.request.done" for e in evs),
    )
    mine = {e["event"]: e for e in events if e.get("request_id") == resp.id}
    assert set(mine) >= {"ignis.request.admitted", "ignis.request.ttft", "ignis.request.done"}
    admitted, ttft, done = mine["ignis.request.admitted"], mine["ignis.request.ttft"], mine["ignis.request.done"]
    assert admitted["class"] == "interactive" and admitted["prompt_tokens"] == resp.usage.prompt_tokens
    assert ttft["ttft"] > 0
    assert done["completion_tokens"] == resp.usage.completion_tokens
    assert done["class"] == "interactive" and done["seconds"] >= done["ttft"] > 0
    assert admitted["ts"] <= ttft["ts"] <= done["ts"]
    plan = next(e for e in events if e["event"] == "ignis.runtime.vram_plan")
    assert plan["weights_bytes"] > 0 and plan["num_blocks"] > 0
    assert any(e["event"] == "ignis.model.loaded" for e in events)
    assert all(e["level"] in ("debug", "info", "warning", "error", "critical") for e in events)


def test_redis_mode_metrics_come_from_the_engine_process(tmp_path, default_gguf_path):
    import shutil

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    redis_port = free_port()
    redis = LiveProcess(
        [exe, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        server_env(tmp_path),
        tmp_path / "redis.log",
    )
    env_extra = {"IGNIS_SERVER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    env = server_env(tmp_path, **env_extra)
    migrate(env)
    engine = LiveProcess([sys.executable, "manage.py", "runengine"], env, tmp_path / "engine.log")
    metrics_port = free_port()
    try:
        server, base = start_server(tmp_path, "--server-metrics-bind", f"127.0.0.1:{metrics_port}", env_extra=env_extra)
        try:
            wait_healthy(base, server)
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            results: list = []
            _chat(base, "What is 2+2?", 6, results)
            scrape = Scrape(url)
            assert scrape.value("ignis_engine_up") == 1
            assert scrape.value("ignis_model_status", status="serving") == 1
            assert scrape.value("ignis_decoded_tokens_total") == results[0].completion_tokens
            assert scrape.value("ignis_request_ttft_seconds_count") == 1  # observed in the engine process
            assert scrape.value("ignis_memory_plan_bytes", part="kv") > 0
            assert "ignis.request.ttft" in engine.log_text()
        finally:
            server.stop()
    finally:
        engine.stop()
        redis.stop()
