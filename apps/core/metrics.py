"""Prometheus metrics on their own loopback listener (``server.metrics_bind``).

Every ``ignis_*`` number comes from one ``engine.status`` reply, asked over the
Channels layer at scrape time, so it is right whether the engine runs inside
this process or in ``runengine`` behind Redis. django-prometheus' HTTP metrics
(this process's default registry) are served beside them. The Playground's
Monitor reads :func:`engine_samples` of the same reply, so it shows the numbers
/metrics has.

The listener is prometheus_client's HTTP server on its own thread; a scrape
runs the status request on the server's event loop and waits for it there.
Asking for status is read-only and never counts as using the model.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from apps.core.engine_client import engine_status
from engine.messages import FAILED, REFUSED, RESTORED, SWITCHED
from engine.status import EngineState, EngineStatus, SchedulerStats

log = logging.getLogger("ignis.metrics")

REQUEST_STATES = ("waiting", "prefilling", "decoding", "preempted")
REQUEST_CLASSES = ("interactive", "agent")
PLAN_PARTS = ("budget", "weights", "workspace", "kv", "host_kv")
SCHEDULER_COUNTERS = {  # SchedulerStats field -> (family, help)
    "admitted": ("ignis_requests_admitted", "Requests the scheduler admitted."),
    "refused": ("ignis_requests_refused", "Requests refused at admission (engine_full, too long, ...)."),
    "finished": ("ignis_requests_finished", "Requests that ended (any reason, aborts included)."),
    "aborted": ("ignis_requests_aborted", "Requests aborted (client gone, stop string, failure)."),
    "preempted": ("ignis_preemptions", "Decoding sequences moved off the device pool."),
    "recomputed": ("ignis_recomputes", "Preemptions that had to recompute (host tier full)."),
    "decoded_tokens": ("ignis_decoded_tokens", "Tokens sampled (prefill's first token included)."),
    "prefilled_tokens": ("ignis_prefilled_tokens", "Prompt tokens run through prefill."),
    "decode_rounds": ("ignis_decode_rounds", "Batched decode rounds run."),
    "prefill_chunks": ("ignis_prefill_chunks", "Prefill chunks run."),
    "spec_trimmed": ("ignis_spec_trimmed_drafts", "Drafts spec.cost_aware kept out of rounds (not worth their rows)."),
}


def _gauge(name: str, doc: str, value: float = 0.0, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    if labels is None:
        return GaugeMetricFamily(name, doc, value=value)
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def _histogram(name: str, doc: str, snap: dict | None) -> HistogramMetricFamily:
    snap = snap or {"bounds": [], "cumulative": [0], "sum": 0.0}
    buckets = [(repr(float(b)), c) for b, c in zip(snap["bounds"], snap["cumulative"])]
    buckets.append(("+Inf", snap["cumulative"][-1]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=snap["sum"])


def engine_families(status: EngineStatus | None) -> list[Metric]:
    """The ``ignis_*`` families of one ``engine.status`` reply (None: the engine did not answer).

    Every family is present whatever the state, reading zero when nothing is
    loaded, so a dashboard's series never vanish across an unload.
    """
    up = status is not None
    state = status.status if up else "unreachable"
    if not up:  # an empty status: every family below reads zero
        status = EngineStatus(status=EngineState.FAILED, model="", backend="")
    model = status.model or ""
    stats = status.stats or SchedulerStats()
    kv = stats.kv_pages or {}
    lanes, tele, plan = status.lanes or {}, status.telemetry or {}, status.plan or {}
    out: list[Metric] = [_gauge("ignis_engine_up", "1 when the engine answered the scrape.", 1.0 if up else 0.0)]

    fam = GaugeMetricFamily("ignis_model_status", "1 for the model's current state.", labels=["model", "status"])
    for s in dict.fromkeys((*EngineState, state)):
        if s != "unreachable":
            fam.add_metric([model, str(s)], 1.0 if s == state else 0.0)
    out.append(fam)
    out.append(
        _gauge(
            "ignis_model_info",
            "The served model.",
            1.0 if up else 0.0,
            {"model": model, "backend": str(status.backend or "")},
        )
    )
    out.append(_gauge("ignis_model_max_context_tokens", "Largest prompt + generation.", status.max_context or 0))
    events = tele.get("model_events") or {}
    fam = CounterMetricFamily("ignis_model_switches", "Model switches by outcome.", labels=["outcome"])
    for outcome in (SWITCHED, REFUSED, RESTORED, FAILED):
        fam.add_metric([outcome], (status.switch_outcomes or {}).get(outcome, 0))
    out.append(fam)
    fam = CounterMetricFamily("ignis_model_events", "ignis.model.* log events by name.", labels=["event"])
    for event, n in sorted(events.items()):
        fam.add_metric([event], n)
    out.append(fam)

    fam = GaugeMetricFamily("ignis_scheduler_requests", "Live requests by state and class.", labels=["state", "class"])
    by_sc = lanes.get("requests_by_state_class") or {}
    classes = dict.fromkeys((*REQUEST_CLASSES, *(c for per in by_sc.values() for c in per)))
    for s in dict.fromkeys((*REQUEST_STATES, *by_sc)):
        for c in classes:
            fam.add_metric([s, c], (by_sc.get(s) or {}).get(c, 0))
    out.append(fam)
    for key, (name, doc) in SCHEDULER_COUNTERS.items():
        out.append(CounterMetricFamily(name, doc, value=getattr(stats, key)))
    for key, name, doc in (
        ("spec_drafted", "ignis_spec_drafted_tokens", "Draft tokens proposed to verify rounds, by drafter."),
        ("spec_accepted", "ignis_spec_accepted_tokens", "Draft tokens the model agreed with, by drafter."),
    ):
        fam = CounterMetricFamily(name, doc, labels=["drafter"])
        counts = getattr(stats, key) or {}
        for drafter in dict.fromkeys(("prompt_lookup", "prediction", *counts)):
            fam.add_metric([drafter], counts.get(drafter, 0))
        out.append(fam)
    fired = stats.loop_guard_fired or {}
    fam = CounterMetricFamily(
        "ignis_loop_guard_fired", "Reasoning take-backs (loop guard, thinking budget), by reason.", labels=["reason"]
    )
    for reason in dict.fromkeys(("loop", "budget", *fired)):
        fam.add_metric([reason], fired.get(reason, 0))
    out.append(fam)
    out.append(
        CounterMetricFamily(
            "ignis_loop_guard_taken_back_tokens",
            "Streamed reasoning tokens the loop guard took back.",
            value=stats.loop_guard_taken_back,
        )
    )
    experts = (status.backend_stats or {}).get("experts") or {}
    for key, name, doc in (
        ("hits", "ignis_expert_cache_hits", "MoE experts a round needed that were on the card."),
        ("misses", "ignis_expert_cache_misses", "MoE experts a round copied over from host RAM."),
        ("bytes_moved", "ignis_expert_cache_moved_bytes", "Bytes of expert weights copied to the card."),
    ):
        out.append(CounterMetricFamily(name, doc, value=experts.get(key, 0)))
    out.append(_gauge("ignis_experts_resident", "MoE experts (layer x expert) resident on the card.",
                      experts.get("resident", 0)))  # fmt: skip
    fam = CounterMetricFamily("ignis_requests_completed", "Finished requests by finish reason.", labels=["reason"])
    for reason in dict.fromkeys(("stop", "length", "abort", *(tele.get("finish_reasons") or {}))):
        fam.add_metric([reason], (tele.get("finish_reasons") or {}).get(reason, 0))
    out.append(fam)

    out.append(_histogram("ignis_request_ttft_seconds", "Admission to first token.", tele.get("ttft_seconds")))
    out.append(
        _histogram(
            "ignis_request_inter_token_seconds", "Gap between a request's tokens.", tele.get("inter_token_seconds")
        )
    )
    out.append(_histogram("ignis_request_e2e_seconds", "Admission to finish.", tele.get("e2e_seconds")))

    lanes_total = stats.lanes_total
    out.append(_gauge("ignis_lanes_total", "Decode lanes (rows of one round).", lanes_total))
    out.append(_gauge("ignis_lanes_busy", "Lanes held by a live request.", stats.lanes_busy))
    out.append(_gauge("ignis_lanes_decoding", "Lanes decoding this round.", stats.lanes_decoding))
    fam = GaugeMetricFamily("ignis_lane_tokens_per_second", "Each busy lane's decode rate.", labels=["lane"])
    held = lanes.get("lanes") or []
    for i in range(max(lanes_total, len(held))):
        fam.add_metric([str(i)], held[i]["tokens_per_second"] if i < len(held) else 0.0)
    out.append(fam)
    prefill = lanes.get("prefill") or {}
    fam = GaugeMetricFamily(
        "ignis_prefill_tokens", "The prompt prefilling now: tokens done and total.", labels=["part"]
    )
    fam.add_metric(["done"], prefill.get("done", 0))
    fam.add_metric(["total"], prefill.get("total", 0))
    out.append(fam)
    out.append(_gauge("ignis_decode_round_seconds", "Moving average of a decode round.", stats.round_seconds or 0.0))

    out.append(_gauge("ignis_kv_pool_pages", "Pages in the device KV pool.", kv.get("total", 0)))
    fam = GaugeMetricFamily("ignis_kv_pages", "Device KV pages by state (they sum to the pool).", labels=["state"])
    for s in ("used", "retained", "free"):
        fam.add_metric([s], kv.get(s, 0))
    out.append(fam)
    out.append(_gauge("ignis_kv_pinned_pages", "Retained pages pinned resident.", kv.get("pinned", 0)))
    out.append(_gauge("ignis_kv_host_pool_pages", "Pages in the host (swap) tier.", kv.get("host_total", 0)))
    out.append(_gauge("ignis_kv_pages_on_host", "Pages swapped out to host RAM.", kv.get("host_used", 0)))
    out.append(_gauge("ignis_kv_page_tokens", "Tokens per KV page.", plan.get("block_size", 0)))
    out.append(
        CounterMetricFamily(
            "ignis_prefix_cache_hits", "Requests that reused retained prompt state.", value=stats.prefix_hits
        )
    )
    out.append(
        CounterMetricFamily(
            "ignis_prefix_cached_tokens",
            "Prompt tokens served from retained state.",
            value=stats.cached_tokens,
        )
    )

    fam = GaugeMetricFamily("ignis_memory_plan_bytes", "The load's memory plan; zero while unloaded.", labels=["part"])
    for part in PLAN_PARTS:
        fam.add_metric([part], plan.get(f"{part}_bytes", 0))
    out.append(fam)
    return out


def engine_samples(status: EngineStatus | None) -> dict[str, float]:
    """The same numbers flat, ``name{label="v",...}`` -> value (what the Monitor reads)."""
    flat = {}
    for fam in engine_families(status):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            flat[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return flat


class EngineCollector:
    """Asks the engine for status on ``loop`` (the server's) at every scrape."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float = 3.0):
        self.loop = loop
        self.timeout = timeout

    def collect(self) -> Iterable[Metric]:
        try:
            future = asyncio.run_coroutine_threadsafe(engine_status(timeout=self.timeout), self.loop)
            status = future.result(self.timeout + 1.0)
        except Exception:  # a scrape must answer even when the engine cannot
            log.warning("ignis.metrics.engine_unreachable", exc_info=True)
            status = None
        return engine_families(status)


def fleet_families(workers) -> list[Metric]:
    """Per-worker gauges from the routing table (apps/core/fleet.py), each with a ``worker`` label:
    what this front end's last heartbeat of every live worker said (docs/FLEET.md)."""
    import time

    now = time.monotonic()
    specs = [
        ("ignis_worker_up", "1 for each engine worker in this front end's routing table.", lambda w: 1),
        ("ignis_worker_lanes_busy", "Busy decode lanes, per worker (its last heartbeat).", lambda w: w.lanes_busy),
        ("ignis_worker_lanes_total", "Decode lanes, per worker.", lambda w: w.lanes_total),
        ("ignis_worker_kv_pages_free", "Free (and evictable) KV pages, per worker.", lambda w: w.kv_pages_free),
        ("ignis_worker_draining", "1 while the worker drains (SIGTERM).", lambda w: int(w.draining)),
        ("ignis_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.", lambda w: now - w.seen_at),
    ]
    out = []
    for name, doc, value in specs:
        fam = GaugeMetricFamily(name, doc, labels=["worker", "model", "host"])
        for worker in workers:
            fam.add_metric([worker.name, worker.model, worker.host], value(worker))
        out.append(fam)
    return out


class FleetCollector:
    """The routing table's per-worker gauges (only where a listener keeps one)."""

    def collect(self) -> Iterable[Metric]:
        from apps.core import engine_state

        if not engine_state.CACHE.listening:
            return []
        return fleet_families(list(engine_state.CACHE.workers.values()))


class _DefaultRegistry:
    """This process's default registry (django-prometheus, process metrics) as one collector."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()


def parse_bind(bind: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) -> (host, port); '' or 'off' -> None."""
    bind = (bind or "").strip()
    if bind.lower() in ("", "off", "none", "0"):
        return None
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"server.metrics_bind must be host:port, not {bind!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_listener(bind: str, loop: asyncio.AbstractEventLoop, public_port: int | None = None):
    """Serve /metrics on ``bind`` from a thread; returns the HTTP server, or None
    when off or the address is taken (logged: the API keeps serving either way)."""
    try:
        addr = parse_bind(bind)
    except ValueError as exc:
        log.error("ignis.metrics.bad_bind", extra={"bind": bind, "error": str(exc)})
        return None
    if addr is None:
        return None
    host, port = addr
    if public_port is not None and port == public_port:
        log.error("ignis.metrics.bad_bind", extra={"bind": bind, "error": "the metrics port is the API's port"})
        return None
    if not is_loopback(host):
        log.warning("ignis.metrics.not_loopback", extra={"bind": bind})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_DefaultRegistry())
    registry.register(EngineCollector(loop))
    registry.register(FleetCollector())
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.error("ignis.metrics.bind_failed", extra={"bind": bind, "error": str(exc)})
        return None
    log.info("ignis.metrics.listening", extra={"bind": f"{host}:{server.server_port}"})
    return server
