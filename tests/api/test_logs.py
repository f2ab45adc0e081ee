"""The structured log stream and the telemetry it feeds, without a server."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from engine.telemetry import Histogram, Telemetry, TelemetryHandler, lanes_snapshot
from ignis_site.jsonlog import JsonFormatter


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def fed():
    """A logger wired to a fresh Telemetry, as the settings wire the real one."""
    clock = FakeClock()
    telemetry = Telemetry(clock=clock)
    logger = logging.getLogger("ignis.test.telemetry")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = TelemetryHandler(telemetry=telemetry)
    logger.addHandler(handler)
    yield logger, telemetry, clock
    logger.removeHandler(handler)


def test_json_formatter_writes_one_object_per_event():
    record = logging.LogRecord("ignis.engine", logging.INFO, __file__, 1, "ignis.request.done", None, None)
    record.request_id, record.completion_tokens = "r1", 7
    entry = json.loads(JsonFormatter().format(record))
    assert entry["event"] == "ignis.request.done" and entry["level"] == "info" and entry["logger"] == "ignis.engine"
    assert entry["request_id"] == "r1" and entry["completion_tokens"] == 7
    assert "msg" not in entry and "args" not in entry


def test_request_events_feed_the_histograms(fed):
    logger, telemetry, clock = fed
    logger.info("ignis.request.admitted", extra={"request_id": "a", "class": "agent", "prompt_tokens": 5})
    clock.now += 0.2
    logger.info("ignis.request.ttft", extra={"request_id": "a", "ttft": 0.2})
    clock.now += 0.9  # 10 tokens: 9 gaps of 0.1 s
    assert telemetry.timings("a") == {"class": "agent", "seconds": 1.1, "ttft": 0.2, "decode_seconds": 0.9}
    logger.info("ignis.request.done", extra={"request_id": "a", "finish_reason": "length", "completion_tokens": 10})
    snap = telemetry.snapshot()
    assert snap["ttft_seconds"]["count"] == 1 and snap["ttft_seconds"]["sum"] == pytest.approx(0.2)
    assert snap["e2e_seconds"]["count"] == 1 and snap["e2e_seconds"]["sum"] == pytest.approx(1.1)
    assert snap["inter_token_seconds"]["count"] == 9
    assert snap["inter_token_seconds"]["sum"] == pytest.approx(0.9)
    assert snap["finish_reasons"] == {"length": 1}
    assert telemetry.timings("a") == {}  # forgotten once done


def test_model_events_are_counted_and_others_ignored(fed):
    logger, telemetry, _ = fed
    logger.info("ignis.model.switched", extra={"result": "switched"})
    logger.info("ignis.model.switched")
    logger.info("ignis.model.unloaded")
    logger.info("ignis.api.something", extra={"request_id": "x"})
    logger.info("ignis.request.done", extra={"request_id": "never-admitted", "completion_tokens": 3})
    snap = telemetry.snapshot()
    assert snap["model_events"] == {"switched": 2, "unloaded": 1}
    assert snap["e2e_seconds"]["count"] == 0  # no admission seen, no e2e observation


def test_a_broken_record_never_raises(fed, monkeypatch):
    """A record the telemetry cannot read is reported through ``handleError``, never raised into the
    code that logged it; it changes nothing, and the records after it still count."""
    logger, telemetry, _ = fed
    handler = next(h for h in logger.handlers if isinstance(h, TelemetryHandler) and h.telemetry is telemetry)
    reported: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", reported.append)
    logger.info("ignis.request.admitted", extra={"request_id": "a"})
    logger.info("ignis.request.ttft", extra={"request_id": "a"})  # no ttft field: emit() would raise
    assert [r.getMessage() for r in reported] == ["ignis.request.ttft"]
    assert telemetry.snapshot()["ttft_seconds"]["count"] == 0 and "ttft" not in telemetry.timings("a")
    logger.info("ignis.request.ttft", extra={"request_id": "a", "ttft": 0.2})
    assert telemetry.snapshot()["ttft_seconds"]["count"] == 1 and reported[1:] == []


def test_histogram_buckets_are_cumulative():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.5, 1.5, 9.0):
        h.observe(v)
    assert h.to_dict()["cumulative"] == [1, 3, 4] and h.count == 4


def test_lanes_snapshot_reads_state_class_and_rates():
    from engine.sequence import SequenceStatus as S

    def seq(i, status, cls, out, first=None, computed=0):
        return SimpleNamespace(
            seq_id=i,
            request_class=cls,
            status=status,
            num_prompt_tokens=10,
            num_computed_tokens=computed,
            num_cached_tokens=0,
            output_token_ids=[1] * out,
            max_tokens=50,
            first_token_time=first,
            num_tokens=10 + out,
            holds_lane=not status.is_finished,
        )

    decoding = seq(0, S.DECODING, "interactive", 11, first=90.0)
    prefilling = seq(1, S.PREFILLING, "agent", 0, computed=4)
    sched = SimpleNamespace(seqs={"a": decoding, "b": prefilling}, prefilling=prefilling)
    snap = lanes_snapshot(sched, now=100.0)
    assert [lane["state"] for lane in snap["lanes"]] == ["decoding", "prefilling"]
    assert snap["lanes"][0]["tokens_per_second"] == pytest.approx(1.0)
    assert snap["prefill"] == {"seq_id": 1, "done": 4, "total": 10}
    assert snap["requests_by_state_class"] == {"decoding": {"interactive": 1}, "prefilling": {"agent": 1}}


def test_worker_logs_the_scheduler_interval_at_debug(caplog):
    from engine.config import EngineConfig
    from engine.status import SchedulerStats
    from engine.worker import EngineWorker

    worker = EngineWorker(layer=None, cfg=EngineConfig(), artifact_path="/nonexistent", served_id="m")
    stats = SchedulerStats(admitted=3, decoded_tokens=40, lanes_busy=1, kv_pages={"used": 2, "total": 8})
    worker.host.scheduler = SimpleNamespace(make_stats=lambda: stats)
    with caplog.at_level(logging.DEBUG, logger="ignis.engine"):
        worker._log_interval()
        worker._log_interval()  # within the interval: once only
    records = [r for r in caplog.records if r.getMessage() == "ignis.scheduler.interval"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert records[0].decoded_tokens == 40 and records[0].kv_used == 2
    worker._thread.shutdown(wait=False)


def test_status_while_nothing_is_loaded_reads_zero_plan():
    from engine.config import EngineConfig
    from engine.worker import EngineWorker

    worker = EngineWorker(layer=None, cfg=EngineConfig(), artifact_path="/nonexistent", served_id="m")
    msg = worker.status_message()
    assert msg["status"] == "loading" and "stats" not in msg
    assert msg["plan"]["weights_bytes"] == 0 and msg["plan"]["kv_bytes"] == 0
    assert "ttft_seconds" in msg["telemetry"]
    worker._thread.shutdown(wait=False)
