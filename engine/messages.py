"""Every message that crosses the Channels layer between the Django side and the engine.

The layer carries plain dicts (msgpack over Redis), so each message is a
dataclass with ``to_message()`` / ``from_message()``. The ``type`` key routes
it: on the engine channel to the worker, on a reply channel to the consumer's
handler (``engine.tokens`` -> ``engine_tokens``).
"""

from __future__ import annotations

import functools
from copy import deepcopy
from dataclasses import asdict, dataclass, field, fields

ENGINE_CHANNEL = "ignis.engine"
STATUS_GROUP = "ignis.status"  # every front end: EngineHeartbeat, on each change and every heartbeat seconds
# A fleet (docs/FLEET.md): a worker started with a worker id listens on its own channel; one
# without (embedded, or a lone ``runengine``) on ENGINE_CHANNEL, as before.
WORKER_CHANNEL_PREFIX = ENGINE_CHANNEL + "."
WORKER_ID_CHARS = 64


def worker_channel(worker_id: str | None) -> str:
    """The channel a worker with ``worker_id`` takes its messages from (ENGINE_CHANNEL without one)."""
    return WORKER_CHANNEL_PREFIX + worker_id if worker_id else ENGINE_CHANNEL


def worker_id_check(worker_id: str) -> str:
    """``worker_id`` if it can name a channel (letters, digits, ``-``, ``_``, ``.``; 1-64); else ValueError."""
    ok = 0 < len(worker_id) <= WORKER_ID_CHARS and all(c.isascii() and (c.isalnum() or c in "-_.") for c in worker_id)
    if not ok:
        raise ValueError(f"a worker id is 1-{WORKER_ID_CHARS} letters, digits, '-', '_' or '.', not {worker_id!r}")
    return worker_id


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


class _Msg:
    TYPE = ""
    # The engine's per-token messages (TokenEvent, RequestFinished, RequestFailed) go out as a shallow
    # dict of their fields (0.6 us for a TokenEvent, asdict's recursive copy 7.7): what they carry is
    # plain data (lists, dicts, strings, numbers) built for that one message (engine/outputs.py) and
    # never touched once sent, and every layer copies (InMemoryChannelLayer, CrossLoopChannelLayer)
    # or serialises (channels_redis' msgpack, after two round trips to Redis) what it is given. The
    # other messages carry what their senders keep (a front end's AddRequest, a status): a deep copy.
    SHALLOW = False

    def to_message(self) -> dict:
        if self.SHALLOW:
            d = {name: getattr(self, name) for name in _field_names(type(self))}
        else:
            d = asdict(self)
        d["type"] = self.TYPE
        return d

    @classmethod
    def from_message(cls, msg: dict):
        return cls(**{f.name: msg[f.name] for f in fields(cls) if f.name in msg})


@dataclass
class AddRequest(_Msg):
    """Django -> engine: serve this prompt, reply on ``reply_channel``."""

    TYPE = "engine.add"
    request_id: str
    reply_channel: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: dict = field(default_factory=dict)  # SamplingParams.to_dict()
    stop_token_ids: list[int] = field(default_factory=list)
    request_class: str = "interactive"  # interactive | agent
    num_logprobs: int = 0
    want_logprobs: bool = False
    model: str | None = None  # the served id the client named (None: whatever is loaded)
    decide: bool = False  # prefill only, return last-position logits
    grammar: str | None = None  # llguidance grammar constraining the output (engine.constraint)
    # Leading prompt tokens that are its system block, kept as a shared prefix once
    # computed (a burst of subagents opening with the same block): KVManager.pin_prefix.
    shared_prefix_len: int = 0
    # Score the prompt: per prompt position after the first, the logprob of its token and this many
    # top alternatives (None: no prompt scoring). Such a request claims no retained prefix.
    prompt_logprobs: int | None = None
    # A decide request naming these ids gets back only their log-softmax values (over the whole
    # last-position row, computed in the engine) instead of the full logits row.
    decide_token_ids: list[int] | None = None
    # OpenAI Predicted Outputs: the tokens the client expects the answer to contain (drafts).
    prediction_token_ids: list[int] | None = None
    # The reasoning channel (engine/spec/reasoning.py), None: not watched. Keys: ``start_ids`` and
    # ``end_ids`` (lists of alternative tokenizations of the start and end tags), ``close_ids`` (forced
    # to end the thinking: the end tag and what follows it), ``open`` (the prompt opened the channel),
    # ``max_tokens`` (the thinking budget, None: none), ``guard`` (the loop guard may watch).
    reasoning: dict | None = None
    # Images of a vision-language model (engine.models.qwen2_5_vl), in prompt order, prepared on the
    # Django side (apps/api/images): each {"hash": hex sha256 of grid_thw and pixel_values (the prefix
    # key's share of the image), "offset": index in prompt_token_ids of its first placeholder token,
    # "num_tokens": its placeholder tokens (t*h*w / merge_size**2), "grid_thw": [t, h, w] in patches,
    # "pixel_values": bytes, float32 little-endian, shape (t*h*w, channels*temporal_patch*patch*patch),
    # the processor's patch order}. None: a text-only prompt.
    images: list[dict] | None = None

    # Its token lists are flat lists of ints, copied as lists (in C); the rest as asdict copies it.
    # asdict copies a list element by element through deepcopy: 2.7 ms for a 4,000-token prompt, 21 ms
    # for 32,000, on the front end's event loop, where every other request and stream waits for it.
    _INT_LISTS = ("prompt_token_ids", "stop_token_ids", "decide_token_ids", "prediction_token_ids")

    def to_message(self) -> dict:
        d = {name: getattr(self, name) for name in _field_names(type(self))}
        for name in self._INT_LISTS:
            if d[name] is not None:
                d[name] = list(d[name])
        for name in ("sampling", "reasoning", "images"):
            if d[name] is not None:
                d[name] = deepcopy(d[name])
        d["type"] = self.TYPE
        return d


@dataclass
class AbortRequest(_Msg):
    """Django -> engine: the client went away or a stop string matched."""

    TYPE = "engine.abort"
    request_id: str


@dataclass
class TokenEvent(_Msg):
    """Engine -> consumer: the tokens one round committed for this request."""

    TYPE = "engine.tokens"
    SHALLOW = True
    request_id: str
    token_ids: list[int]
    logprobs: list[dict] | None = None  # per token: {token_id, logprob, top: [[id, lp], ...]}
    cached_tokens: int = 0
    ttft: float | None = None  # set on the first event
    # AddRequest.prompt_logprobs: on the first event (or RequestFinished when none was sent),
    # one item per prompt position after the first, shaped as ``logprobs``.
    prompt_logprobs: list[dict] | None = None
    # A take-back (the loop guard or the thinking budget): before ``token_ids`` (the forced end of the
    # thinking), this many already-streamed tokens were taken back, for ``taken_back_reason``
    # (loop | budget; None: no take-back in this event).
    taken_back: int = 0
    taken_back_reason: str | None = None


@dataclass
class RequestFinished(_Msg):
    """Engine -> consumer: the request is done; its lane and pages are free."""

    TYPE = "engine.finished"
    SHALLOW = True
    request_id: str
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logits: list[float] | None = None  # decide requests only
    prompt_logprobs: list[dict] | None = None  # see TokenEvent.prompt_logprobs
    # Decide requests with decide_token_ids: log-softmax per id, in that order (None: id out of range).
    decide_logprobs: list[float | None] | None = None
    # Predicted Outputs (AddRequest.prediction_token_ids): prediction tokens drafted and kept / rejected.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Speculative rounds, every drafter: drafts verified for this request and drafts kept.
    spec_drafted: int = 0
    spec_accepted: int = 0
    # Tokens taken back by the loop guard (counted in completion_tokens: they were generated and sent).
    taken_back_tokens: int = 0


@dataclass
class RequestFailed(_Msg):
    """Engine -> consumer: refused or failed; rendered as an OpenAI error."""

    TYPE = "engine.failed"
    SHALLOW = True
    request_id: str
    message: str
    code: str  # engine_full | context_length_exceeded | engine_error | ...
    status: int = 503
    error_type: str = "server_error"
    param: str | None = None
    retry_after: float | None = None


# -- the model: switches, unloads, live configuration ------------------------------------

# Outcomes of a switch, as GET /v1/models reports them in ``last_switch``.
SWITCHED, REFUSED, RESTORED, FAILED = "switched", "refused", "restored", "failed"
# A switch to what serves already: answered at once (SwitchAck.unchanged), never a last_switch.
UNCHANGED = "unchanged"


@dataclass
class SwitchModel(_Msg):
    """Django -> engine: replace the loaded model (or reload it with ``config``)."""

    TYPE = "engine.switch"
    switch_id: str
    served_id: str
    path: str
    sha256: str | None = None
    config: dict = field(default_factory=dict)  # EngineConfig fields to load with (a config reload)
    trigger: str = "explicit"  # explicit | implicit | config
    reply_channel: str | None = None  # gets SwitchAck, then SwitchDone
    refuse: str | None = None  # the Django side already knows it cannot proceed


@dataclass
class SwitchAck(_Msg):
    """Engine -> requester, at once: accepted, or refused because a switch runs."""

    TYPE = "engine.switch_ack"
    switch_id: str
    accepted: bool
    message: str = ""
    # The target is what serves already (same id, artifact and configuration): nothing
    # happens, no SwitchDone follows, and nothing is recorded as a switch.
    unchanged: bool = False


@dataclass
class SwitchDone(_Msg):
    """Engine -> requester: how the switch ended (switched | refused | restored | failed)."""

    TYPE = "engine.switch_done"
    switch_id: str
    outcome: str
    reason: str
    served_id: str  # the model serving now (or the one that failed)
    seconds: float = 0.0
    path: str = ""  # served_id's artifact


@dataclass
class EngineHeartbeat(_Msg):
    """Engine -> every front end (group STATUS_GROUP): its status, sent whenever the state,
    the served model or the switch history changes and at least every ``heartbeat`` seconds.

    Front ends answer requests from the last one (apps/core/engine_state.py); one that
    hears none for ``server.engine_timeout`` seconds takes the engine for gone and ends
    the requests it sent: ``waiting_request_ids`` (admitted or queued, no token yet) with
    engine_unavailable, the rest with engine_error. The worker beats soon after a
    request's first token, so a stream is seldom still listed as waiting.
    """

    TYPE = "engine.heartbeat"
    # Built for the one beat (EngineWorker.heartbeat_message: a status dict and id lists made for it),
    # so it goes out shallow: asdict's second deep copy of the status was half a beat's 0.7 ms, and
    # in runengine a beat goes out before every batch of first tokens (beats_before_first_tokens).
    SHALLOW = True
    engine_id: str  # one per worker process and start: a restarted engine has another
    heartbeat: float
    status: dict  # EngineStatus.to_message()
    running_request_ids: list[str] = field(default_factory=list)
    waiting_request_ids: list[str] = field(default_factory=list)
    # The fleet's routing table (apps/core/fleet.py) reads these; an older engine sends none of them
    # and reads as the one worker on ENGINE_CHANNEL.
    worker_id: str = ""  # --worker-id ('' : the unnamed worker on ENGINE_CHANNEL)
    channel: str = ENGINE_CHANNEL  # where its requests, aborts, switches and status asks go
    host: str = ""
    model: str = ""  # the served id (status["model"])
    lanes_busy: int = 0
    lanes_total: int = 0
    kv_pages_free: int = 0  # free plus retained (evictable) device pages
    draining: bool = False  # SIGTERM: admits nothing new; running requests finish
    leaving: bool = False  # the last beat of a worker that drained and exits: out of the table at once


@dataclass
class UnloadModel(_Msg):
    """Django -> engine: unload now (as idle unload would), once nothing runs."""

    TYPE = "engine.unload"


@dataclass
class ConfigureEngine(_Msg):
    """Django -> engine: live settings (no reload): LIVE_FIELDS, idle_unload, drain_timeout."""

    TYPE = "engine.configure"
    values: dict = field(default_factory=dict)
    reply_channel: str | None = None  # gets EngineConfigured once applied


@dataclass
class EngineConfigured(_Msg):
    """Engine -> requester: the ConfigureEngine values are applied."""

    TYPE = "engine.configured"


@dataclass
class StatusRequest(_Msg):
    """Django -> engine: answer on ``reply_channel`` with the EngineStatus (engine/status.py),
    at once, from the receive loop (asking never counts as using the model)."""

    TYPE = "engine.status"
    reply_channel: str
