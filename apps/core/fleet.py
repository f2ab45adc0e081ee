"""The fleet as one front end sees it: a routing table of engine workers, fed by their heartbeats.

Every worker publishes an EngineHeartbeat (engine/messages.py) to STATUS_GROUP:
its channel, worker id, host, the model it serves, its state, lanes busy and
total, KV pages free, and which requests it holds. The listener
(apps/core/engine_state.py) hands each beat to ``Fleet.take``; the engine
client asks ``Fleet.route`` where a request goes. Embedded mode is a fleet of
one: the in-process worker on ENGINE_CHANNEL.

Routing (docs/FLEET.md): a request goes to a live worker that serves the model
it names and is neither draining nor switching, the least loaded by lanes
(busy lanes from its last beat plus what this front end sent it since), then
the one with the most KV pages free, then the one this front end picked least
recently. A worker that serves another model is never picked while one that
serves the named model exists.

Faults: a worker silent for ``server.worker_timeout`` seconds (0: the
``server.engine_timeout``) leaves the table (``expire``). What this front end
sent it ends: a request its last beat listed as waiting (admitted or queued, no
token yet) is sent again to a live worker serving the model, or answered 503
``engine_unavailable`` with Retry-After when there is none; anything else may
have streamed and ends with an ``engine_error`` event. A worker that comes back
with another engine id (restarted under the same worker id) is handled the same
way for what its previous engine held. A draining worker (SIGTERM) stays in the
table but gets nothing new; its ``leaving`` beat takes it out at once. It answers
everything it took before that beat; as a net should it not, what this front end
sent it and has not seen the last message of (``reply_heard``) ends with
``engine_error`` ``server.worker_timeout`` seconds later (``departed_due``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.messages import ENGINE_CHANNEL, EngineHeartbeat
from engine.status import EngineState, EngineStatus

POLICIES = ("idle", "least_loaded", "none")


@dataclass
class Worker:
    """One row of the routing table: the worker's last heartbeat, and when it came."""

    channel: str
    worker_id: str
    engine_id: str
    host: str
    status: EngineStatus
    lanes_busy: int
    lanes_total: int
    kv_pages_free: int
    draining: bool
    seen_at: float
    heartbeat: float = 1.0
    waiting: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)
    sent_since_beat: int = 0  # requests this front end sent it that its last beat cannot know yet
    picked_at: int = 0  # this front end's pick counter when it last got a request

    @property
    def name(self) -> str:
        """The worker's id, as /v1/models and the metrics' ``worker`` label show it."""
        return self.worker_id or "engine"

    @property
    def model(self) -> str:
        return self.status.model

    @property
    def state(self) -> EngineState:
        return self.status.status

    def routable_for(self, model: str) -> bool:
        return self.model == model and not self.draining and self.state is not EngineState.SWITCHING

    def load(self) -> float:
        return (self.lanes_busy + self.sent_since_beat) / max(self.lanes_total, 1)

    def describe(self) -> dict:
        """The worker as GET /v1/models lists it under each model."""
        return {
            "id": self.name,
            "host": self.host,
            "status": "draining" if self.draining else str(self.state),
            "lanes_busy": self.lanes_busy,
            "lanes_total": self.lanes_total,
            "kv_pages_free": self.kv_pages_free,
            "kv_pages_used": int(((self.status.stats.kv_pages if self.status.stats else None) or {}).get("used", 0)),
            "running": len(self.running),
            "waiting": len(self.waiting),
        }


@dataclass
class Sent:
    """A request this front end sent, kept until the worker it went to stops listing it."""

    channel: str  # the worker's
    reply_channel: str
    at: float
    message: dict  # the AddRequest as sent: a request queued on a worker that died is sent again


class Fleet:
    """The routing table. ``listening`` is False where no listener runs (management commands,
    most unit tests): everything then goes to ENGINE_CHANNEL as it always did."""

    def __init__(self) -> None:
        self.listening = False
        self.workers: dict[str, Worker] = {}  # by channel
        self.sent: dict[str, Sent] = {}  # request_id -> where it went
        # channel -> when its worker said goodbye (a leaving beat): what this front end sent it and still
        # holds open ends once ``departed_due`` says so (its consumers may not have read their last
        # messages yet, queued behind the tokens: an end sent now could even overtake them).
        self.departed: dict[str, float] = {}
        self._picks = itertools.count(1)

    # -- the heartbeats -----------------------------------------------------------------------

    def take(self, beat: EngineHeartbeat, now: float) -> bool:
        """Note ``beat``; True when no worker was available before it."""
        came_back = not self.available
        if beat.leaving:  # drained: out of the routing at once; what it held here stays until departed_due
            self.workers.pop(beat.channel, None)
            self.departed.setdefault(beat.channel, now)
            return came_back
        status = EngineStatus.from_message(beat.status)
        old = self.workers.get(beat.channel)
        worker = Worker(
            channel=beat.channel,
            worker_id=beat.worker_id,
            engine_id=beat.engine_id,
            host=beat.host,
            status=status,
            lanes_busy=beat.lanes_busy,
            lanes_total=beat.lanes_total,
            kv_pages_free=beat.kv_pages_free,
            draining=beat.draining,
            seen_at=now,
            heartbeat=beat.heartbeat,
            waiting=set(beat.waiting_request_ids),
            running=set(beat.running_request_ids),
            picked_at=old.picked_at if old is not None else 0,
        )
        self.workers[beat.channel] = worker
        # A request the worker does not list has finished, unless it was sent so recently that
        # the worker may not have had it when it wrote this heartbeat.
        keep = worker.waiting | worker.running
        self._forget(beat.channel, keep=keep, now=now, grace=2 * max(beat.heartbeat, 0.5))
        worker.sent_since_beat = sum(1 for r, s in self.sent.items() if s.channel == beat.channel and r not in keep)
        return came_back

    def restarted(self, beat: EngineHeartbeat) -> Worker | None:
        """The previous engine behind ``beat``'s channel when this beat comes from another one
        (a worker restarted under the same id before this front end noticed it was gone)."""
        old = self.workers.get(beat.channel)
        return old if old is not None and old.engine_id != beat.engine_id and not beat.leaving else None

    def _forget(self, channel: str, *, keep: set[str], now: float, grace: float) -> None:
        self.sent = {
            rid: s for rid, s in self.sent.items() if s.channel != channel or rid in keep or now - s.at < grace
        }

    def expire(self, now: float, timeout: float) -> list[Worker]:
        """The workers silent for more than ``timeout`` seconds, taken out of the table."""
        gone = [w for w in self.workers.values() if now - w.seen_at > timeout]
        for worker in gone:
            del self.workers[worker.channel]
        return gone

    def departed_due(self, now: float, grace: float) -> list[str]:
        """The channels of workers that left more than ``grace`` seconds ago, taken off ``departed``."""
        due = [channel for channel, at in self.departed.items() if now - at >= grace]
        for channel in due:
            del self.departed[channel]
        return due

    def unrouted(self) -> dict[str, Sent]:
        """What was sent while no worker was known (not what a worker that left still holds), taken out."""
        mine = {rid: s for rid, s in self.sent.items() if s.channel not in self.departed}
        for rid in mine:
            del self.sent[rid]
        return mine

    def orphans(self, channel: str) -> dict[str, Sent]:
        """What this front end sent the worker on ``channel`` (gone, replaced or leaving), taken out of ``sent``."""
        mine = {rid: s for rid, s in self.sent.items() if s.channel == channel}
        for rid in mine:
            del self.sent[rid]
        return mine

    # -- what the rest of the front end reads ---------------------------------------------------

    @property
    def available(self) -> bool:
        return bool(self.workers)

    def live(self) -> list[Worker]:
        return sorted(self.workers.values(), key=lambda w: (w.name, w.channel))

    def primary(self, default_model: str | None = None) -> Worker | None:
        """The worker whose status reads as "the engine's" (GET /health, the gate, the served model):
        the one worker of a fleet of one; else the first (by id) serving ``default_model``, else the first."""
        live = self.live()
        serving = [w for w in live if default_model and w.model == default_model]
        return (serving or live or [None])[0]

    @property
    def status(self) -> EngineStatus | None:
        """The primary worker's status (see ``primary``; the default model is not known down here)."""
        worker = self.primary(default_model())
        return worker.status if worker is not None else None

    @property
    def waiting(self) -> set[str]:
        return set().union(*(w.waiting for w in self.workers.values())) if self.workers else set()

    @property
    def engine_id(self) -> str | None:
        worker = self.primary(default_model())
        return worker.engine_id if worker is not None else None

    def models(self) -> dict[str, list[Worker]]:
        """Served id -> the live workers serving it."""
        out: dict[str, list[Worker]] = {}
        for worker in self.live():
            if worker.model:
                out.setdefault(worker.model, []).append(worker)
        return out

    def serving(self, model: str) -> list[Worker]:
        return [w for w in self.live() if w.routable_for(model)]

    def route(self, model: str | None) -> Worker | None:
        """The worker a request naming ``model`` goes to (None: no live worker serves it)."""
        if model is None:
            worker = self.primary(default_model())
            model = worker.model if worker is not None else None
        candidates = [w for w in self.workers.values() if model and w.routable_for(model)]
        if not candidates:
            return None
        best = min(
            candidates,
            key=lambda w: (w.state is EngineState.FAILED, w.load(), -w.kv_pages_free, w.picked_at, w.name),
        )
        best.picked_at = next(self._picks)
        return best

    def channel_for(self, model: str | None) -> str:
        """Where a request for ``model`` goes: its worker's channel; ENGINE_CHANNEL without a table, and the
        primary's when no worker serves it (the worker refuses it as it did when the model changed)."""
        worker = self.route(model) if self.workers else None
        if worker is None:
            worker = self.primary(default_model())
        return worker.channel if worker is not None else ENGINE_CHANNEL

    def record(self, request_id: str, channel: str, message: dict, now: float) -> None:
        self.sent[request_id] = Sent(channel, message["reply_channel"], now, message)
        worker = self.workers.get(channel)
        if worker is not None:
            worker.sent_since_beat += 1

    def switch_candidate(self, policy: str, model: str) -> Worker | None:
        """The worker an implicit switch to ``model`` takes (``switch.fleet_policy``); None: none may.

        ``idle``: a worker with no busy lane first, then one whose model another worker serves too (the
        switch leaves no model unserved), then the longest idle. ``least_loaded``: the fewest busy lanes,
        then the most KV pages free. ``none``: a fleet of more than one worker never switches implicitly.
        Draining and switching workers are never taken.
        """
        if len(self.workers) == 1:  # a fleet of one (embedded): the engine itself refuses what it must (409)
            return next(iter(self.workers.values()))
        live = [w for w in self.live() if not w.draining and w.state is not EngineState.SWITCHING]
        if not live:
            return None
        if policy == "none":
            return None
        counts = {m: len(ws) for m, ws in self.models().items()}
        if policy == "least_loaded":
            return min(live, key=lambda w: (w.load(), -w.kv_pages_free, w.name))
        return min(
            live,
            key=lambda w: (
                w.lanes_busy + len(w.waiting) > 0,
                counts.get(w.model, 0) < 2,
                -w.status.idle_seconds,
                w.name,
            ),
        )

    def note_model(self, channel: str, model: str, path: str) -> None:
        """A switch on ``channel``'s worker landed: route to it for ``model`` before its next beat says so."""
        import dataclasses

        worker = self.workers.get(channel)
        if worker is not None:
            worker.status = dataclasses.replace(worker.status, model=model, path=path, status=EngineState.SERVING)


def default_model() -> str | None:
    """The configured ``model.id``: requests naming no model go to its workers."""
    from django.conf import settings

    return settings.IGNIS.get("model.id")
