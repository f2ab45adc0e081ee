"""Engine-side telemetry: request timings, lane detail and model events, kept
where the engine runs and shipped in the ``engine.status`` reply.

The engine's log is its event stream: ``ignis.request.admitted``, ``.ttft``,
``.done`` and ``ignis.model.*``. :class:`TelemetryHandler` (wired into the
``ignis`` logger by the settings' LOGGING) reads those records and keeps the
histograms Prometheus wants, so the request path carries no metric calls and
the numbers are right in whichever process hosts the loop (embedded in the
server, or ``runengine`` behind Redis). The Django side turns ``snapshot()``
into metric families; nothing here imports Django or prometheus_client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

# Seconds. Wide enough for a CPU backend's first token and a GPU's inter-token gap.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MAX_OPEN_REQUESTS = 10_000  # requests failed mid-step never log done; forget the oldest


class Histogram:
    """Cumulative buckets as Prometheus keeps them; ``observe`` takes a weight."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, weight: int = 1) -> None:
        if weight <= 0:
            return
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += weight
                break
        else:
            self.counts[-1] += weight
        self.sum += value * weight
        self.count += weight

    def to_dict(self) -> dict:
        cumulative, running = [], 0
        for n in self.counts:
            running += n
            cumulative.append(running)
        return {"bounds": list(self.bounds), "cumulative": cumulative, "sum": self.sum, "count": self.count}


class Telemetry:
    """What the engine process has seen since it started. Thread-safe (logs
    come from the loop and the step thread)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finish_reasons: dict[str, int] = {}
        self.model_events: dict[str, int] = {}
        self.completion_tokens = 0
        self._open: OrderedDict[str, list] = OrderedDict()  # id -> [admitted, first token, class]

    def request_admitted(self, request_id: str, request_class: str | None = None) -> None:
        with self._lock:
            self._open[request_id] = [self.clock(), None, request_class]
            while len(self._open) > MAX_OPEN_REQUESTS:
                self._open.popitem(last=False)

    def request_ttft(self, request_id: str, ttft: float) -> None:
        with self._lock:
            self.ttft.observe(ttft)
            if request_id in self._open:
                self._open[request_id][1] = self.clock()

    def request_done(self, request_id: str, finish_reason: str | None, completion_tokens: int) -> None:
        now = self.clock()
        with self._lock:
            reason = finish_reason or "stop"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            self.completion_tokens += completion_tokens or 0
            admitted, first, _ = self._open.pop(request_id, (None, None, None))
            if admitted is not None:
                self.e2e.observe(now - admitted)
            if first is not None and completion_tokens and completion_tokens > 1:
                # One observation per gap, each the request's mean gap: rounds commit
                # tokens in bursts, so per-round gaps would say the same thing noisier.
                gaps = completion_tokens - 1
                self.itl.observe((now - first) / gaps, weight=gaps)

    def timings(self, request_id: str) -> dict:
        """Class and seconds so far of an open request, for its ``ignis.request.done`` line."""
        now = self.clock()
        with self._lock:
            admitted, first, request_class = self._open.get(request_id, (None, None, None))
        out: dict[str, Any] = {}
        if request_class is not None:
            out["class"] = request_class
        if admitted is not None:
            out["seconds"] = round(now - admitted, 4)
            if first is not None:
                out["ttft"] = round(first - admitted, 4)
                out["decode_seconds"] = round(now - first, 4)
        return out

    def model_event(self, event: str) -> None:
        with self._lock:
            self.model_events[event] = self.model_events.get(event, 0) + 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "ttft_seconds": self.ttft.to_dict(),
                "inter_token_seconds": self.itl.to_dict(),
                "e2e_seconds": self.e2e.to_dict(),
                "finish_reasons": dict(self.finish_reasons),
                "model_events": dict(self.model_events),
                "completion_tokens": self.completion_tokens,
            }


TELEMETRY = Telemetry()


class TelemetryHandler(logging.Handler):
    """Feeds :data:`TELEMETRY` from the engine's structured log records."""

    def __init__(self, level: int = logging.NOTSET, telemetry: Telemetry | None = None):
        super().__init__(level)
        self.telemetry = telemetry or TELEMETRY

    def emit(self, record: logging.LogRecord) -> None:
        event = record.msg if isinstance(record.msg, str) else ""
        if not event.startswith(("ignis.request.", "ignis.model.")):
            return
        try:
            fields = record.__dict__
            if event == "ignis.request.admitted":
                self.telemetry.request_admitted(fields["request_id"], fields.get("class"))
            elif event == "ignis.request.ttft":
                self.telemetry.request_ttft(fields["request_id"], float(fields["ttft"]))
            elif event == "ignis.request.done":
                self.telemetry.request_done(
                    fields["request_id"], fields.get("finish_reason"), int(fields.get("completion_tokens") or 0)
                )
            elif event.startswith("ignis.model."):
                self.telemetry.model_event(event.removeprefix("ignis.model."))
        except Exception:  # telemetry must never break the loop that logs
            self.handleError(record)


def lanes_snapshot(scheduler, now: float | None = None) -> dict[str, Any]:
    """Per-request detail the Monitor draws: who holds a lane, how far its
    prompt has prefilled, how fast it decodes; requests by state and class."""
    now = time.monotonic() if now is None else now
    lanes, prefill = [], None
    by_state_class: dict[str, dict[str, int]] = {}
    for seq in sorted(scheduler.seqs.values(), key=lambda s: s.seq_id):
        state = seq.status.name.lower()
        per_class = by_state_class.setdefault(state, {})
        per_class[seq.request_class] = per_class.get(seq.request_class, 0) + 1
        num_out = len(seq.output_token_ids)
        entry = {
            "seq_id": seq.seq_id,
            "class": seq.request_class,
            "state": state,
            "prompt_tokens": seq.num_prompt_tokens,
            "computed_tokens": seq.num_computed_tokens,
            "cached_tokens": seq.num_cached_tokens,
            "output_tokens": num_out,
            "max_tokens": seq.max_tokens,
            "tokens_per_second": 0.0,
        }
        if seq.first_token_time is not None and num_out > 1 and now > seq.first_token_time:
            entry["tokens_per_second"] = round((num_out - 1) / (now - seq.first_token_time), 3)
        if seq is scheduler.prefilling:
            prefill = {"seq_id": seq.seq_id, "done": seq.num_computed_tokens, "total": seq.num_tokens}
        if seq.holds_lane:
            lanes.append(entry)
    return {"lanes": lanes, "prefill": prefill, "requests_by_state_class": by_state_class}
