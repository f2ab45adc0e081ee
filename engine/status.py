"""The engine's state as everyone outside the loop reads it.

``EngineStatus`` is the one reply to ``engine.status`` (metrics, the
Playground, the API views, the model views and switching all read it);
``SchedulerStats`` is the scheduler's part of it (``Scheduler.make_stats()``).
Both cross the Channels layer as plain dicts: ``to_message()`` on the engine
side, ``EngineStatus.from_message()`` on the Django side.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields


class EngineState(enum.StrEnum):
    """The model host's state (GET /v1/models ``status``)."""

    LOADING = "loading"
    SERVING = "serving"
    SWITCHING = "switching"  # a switch is accepted: draining, then teardown and load
    UNLOADED = "unloaded"  # idle unload (or an unload request); the next request reloads
    FAILED = "failed"  # the last load failed; the next request tries again


@dataclass
class SchedulerStats:
    requests_by_state: dict[str, int] = field(default_factory=dict)
    requests_by_class: dict[str, int] = field(default_factory=dict)
    lanes_total: int = 0
    lanes_busy: int = 0
    lanes_decoding: int = 0
    kv_pages: dict[str, int] = field(default_factory=dict)  # KVManager.usage()
    prefix_hits: int = 0
    cached_tokens: int = 0
    round_seconds: float | None = None
    # Counters since load.
    admitted: int = 0
    refused: int = 0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0
    recomputed: int = 0
    decoded_tokens: int = 0
    prefilled_tokens: int = 0
    decode_rounds: int = 0
    prefill_chunks: int = 0
    spec_trimmed: int = 0  # drafts spec.cost_aware kept out of the rounds (engine/spec/cost.py)
    spec_drafted: dict[str, int] = field(default_factory=dict)  # by drafter: drafts proposed
    spec_accepted: dict[str, int] = field(default_factory=dict)  # ... and accepted
    loop_guard_fired: dict[str, int] = field(default_factory=dict)  # take-backs by reason: loop | budget
    loop_guard_taken_back: int = 0  # output tokens those take-backs took back


@dataclass
class EngineStatus:
    TYPE = "engine.status"

    status: EngineState
    model: str
    error: str | None = None
    backend: str = "numpy"
    max_context: int = 0
    path: str = ""
    switching: dict | None = None  # {from, to} while a switch runs
    last_switch: dict | None = None
    recent_switches: list[dict] = field(default_factory=list)
    switch_outcomes: dict[str, int] = field(default_factory=dict)
    load_progress: dict | None = None  # {done, total, unit} while loading
    idle_unload: float = 0.0
    idle_seconds: float = 0.0
    stats: SchedulerStats | None = None  # None while nothing is loaded
    lanes: dict | None = None  # engine.telemetry.lanes_snapshot
    plan: dict = field(default_factory=dict)  # engine.memory.MemoryPlan as a dict (zeros while unloaded)
    telemetry: dict = field(default_factory=dict)  # engine.telemetry.TELEMETRY.snapshot()
    backend_stats: dict = field(default_factory=dict)  # Backend.stats(): e.g. the CUDA expert cache's counters

    def to_message(self) -> dict:
        """The wire dict: ``type`` first; ``stats`` and ``lanes`` only while a model is loaded."""
        d = {"type": self.TYPE, **asdict(self)}
        d["status"] = str(self.status)
        for key in ("stats", "lanes"):  # absent while nothing is loaded, as GET /health shows it
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_message(cls, msg: dict) -> EngineStatus:
        d = {f.name: msg[f.name] for f in fields(cls) if f.name in msg}
        d["status"] = EngineState(d.get("status", EngineState.FAILED))
        if d.get("stats") is not None:
            names = {f.name for f in fields(SchedulerStats)}
            d["stats"] = SchedulerStats(**{k: v for k, v in d["stats"].items() if k in names})
        return cls(**d)
