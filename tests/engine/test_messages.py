"""engine/messages.py's wire dicts: the per-token messages go out shallow (their fields as they
are), and every layer still gets plain data that nothing shares.

* ``to_message`` of a shallow message equals the deep (asdict) one, and holds only plain data.
* Each layer copies or serialises on send (InMemoryChannelLayer, CrossLoopChannelLayer,
  channels_redis' msgpack): a sender's later change never reaches the receiver.
* The worker, serving streams with logprobs (nested lists and dicts), an abort and a refusal,
  never changes a message once sent, and no two messages it sends share a list or a dict.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import asdict

from channels.layers import InMemoryChannelLayer
from channels_redis.core import RedisChannelLayer

from engine.backend import TokenLogprob
from engine.messages import AbortRequest, AddRequest, EngineHeartbeat, RequestFailed, RequestFinished, TokenEvent
from ignis_site.channel_layer import CrossLoopChannelLayer
from tests.engine import test_worker
from tests.engine.fake_backend import FakeBackend
from tests.engine.test_worker import TIMEOUT, Engine, run

models = test_worker.models  # the fixture
PLAIN = (str, int, float, bool, bytes, type(None))


def hot_messages() -> list:
    lps = [{"token_id": 5, "logprob": -0.25, "top": [[5, -0.25], [9, -1.5]]}]
    return [
        TokenEvent(
            "r1", [5, 6], lps, 3, 0.01, prompt_logprobs=copy.deepcopy(lps), taken_back=1, taken_back_reason="loop"
        ),
        RequestFinished("r1", "length", 4, 2, 3, [0.5, -1.0], copy.deepcopy(lps), [None, -0.5], spec_drafted=2),
        RequestFailed("r2", "no", "engine_full", retry_after=1.5, param="model"),
    ]


def plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return isinstance(value, PLAIN)


def containers(value, found: list) -> list:
    """Every list and dict inside ``value`` (itself included)."""
    if isinstance(value, dict | list):
        found.append(value)
        for v in value.values() if isinstance(value, dict) else value:
            containers(v, found)
    return found


def test_the_per_token_messages_are_shallow_and_equal_to_the_deep_ones():
    for msg in hot_messages():
        wire = msg.to_message()
        assert wire == {**asdict(msg), "type": msg.TYPE} and plain(wire)
        assert type(msg).SHALLOW and type(msg).from_message(wire) == msg
    # The others carry what their senders keep (an AddRequest the front end resends): a deep copy.
    add = AddRequest("r1", "reply", [1, 2], 4, sampling={"temperature": 0.5})
    assert add.to_message()["sampling"] is not add.sampling
    assert not AddRequest.SHALLOW and not AbortRequest.SHALLOW
    # But a heartbeat is built for the one beat (the worker's test below checks it shares nothing).
    beat = EngineHeartbeat("e", 1.0, {"stats": {"kv_pages": {"free": 3}}})
    wire = beat.to_message()
    assert EngineHeartbeat.SHALLOW and wire["status"] is beat.status and wire == {**asdict(beat), "type": beat.TYPE}


def test_a_request_goes_out_as_asdict_copies_it_sharing_nothing_with_its_sender():
    """AddRequest.to_message copies its token lists as lists (asdict's element-wise deepcopy took 2.7 ms
    for a 4,000-token prompt): the same message, and no list or dict of it is the sender's."""
    add = AddRequest(
        "r1", "reply", list(range(4000)), 64, sampling={"temperature": 0.5, "logit_bias": {"7": -1.0}, "stop": ["x"]},
        stop_token_ids=[2, 3], request_class="agent", num_logprobs=2, want_logprobs=True, model="m", grammar="g",
        shared_prefix_len=16, prompt_logprobs=1, decide_token_ids=[4, 5], prediction_token_ids=[6, 7, 8],
        reasoning={"start_ids": [[1]], "end_ids": [[2], [3, 4]], "open": True, "max_tokens": None},
        images=[{"hash": "ab", "offset": 3, "num_tokens": 4, "grid_thw": [1, 4, 4], "pixel_values": b"\0" * 8}],
    )  # fmt: skip
    wire = add.to_message()
    assert wire == {**asdict(add), "type": add.TYPE} and plain(wire)
    assert AddRequest.from_message(wire) == add
    mine = {id(c) for c in containers(add.__dict__, [])}  # every list and dict the sender holds
    assert not [c for c in containers(wire, []) if id(c) in mine]
    sparse = AddRequest("r2", "reply", [1], 1)
    assert sparse.to_message() == {**asdict(sparse), "type": sparse.TYPE}


def test_every_layer_copies_or_serialises_on_send():
    async def through(layer) -> list[dict]:
        out = []
        for msg in hot_messages():
            wire = msg.to_message()
            sent = copy.deepcopy(wire)
            await layer.send("c", wire)
            for c in containers(wire, [])[1:]:  # the sender changes everything it holds, nested too
                c.clear()
            got = await layer.receive("c")
            assert got == sent and plain(got)
            out.append(got)
        return out

    asyncio.run(through(InMemoryChannelLayer()))
    asyncio.run(through(CrossLoopChannelLayer()))
    redis = RedisChannelLayer(hosts=[("127.0.0.1", 1)])  # no connection: its serialiser only
    for msg in hot_messages():
        wire = msg.to_message()
        blob = redis.serialize(wire)
        sent = copy.deepcopy(wire)
        for c in containers(wire, [])[1:]:
            c.clear()
        assert redis.deserialize(blob) == sent


class Recording(InMemoryChannelLayer):
    """Keeps every message the worker sends as the very dict it was given, beside a copy made then."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[dict, dict]] = []

    async def send(self, channel, message):
        self.kept.append((message, copy.deepcopy(message)))
        await super().send(channel, message)

    async def group_send(self, group, message):  # the heartbeats
        self.kept.append((message, copy.deepcopy(message)))
        await super().group_send(group, message)


class LogprobBackend(FakeBackend):
    """The fake, with logprobs for every decoded token (nested lists, as a real backend gives)."""

    def decode_round(self, lanes, out) -> None:
        super().decode_round(lanes, out)
        out.decode_logprobs = [TokenLogprob(t, -0.5, [(t, -0.5), ((t + 1) % 7, -2.0)]) for t in out.decode_tokens]


def test_the_worker_never_changes_a_message_it_sent_and_shares_nothing_between_two(models):
    m1 = models.model("m1")

    def backend(name, config=None):
        made = LogprobBackend(*models.sizes)
        made.before_step = models._before_step
        models.backends.append(made)
        return made

    async def scenario():
        e = Engine(models, m1)
        e.worker.host._backend_factory = backend  # the fake, with logprobs
        layer = e.layer = e.worker.layer = Recording()
        async with e:
            adds = [await e.submit(max_tokens=6, want_logprobs=True, num_logprobs=1) for _ in range(3)]
            too_long = await e.submit(prompt=[1] * 600, max_tokens=4)  # over max_context: refused
            for add in adds:
                tokens, last = await e.outcome(add)
                assert last["type"] == "engine.finished" and len(tokens) == 6
            _, refused = await e.outcome(too_long)
            assert refused["type"] == "engine.failed"
            models.step_gate.close()
            aborted = await e.submit(max_tokens=50, want_logprobs=True, num_logprobs=1)
            await asyncio.wait_for(asyncio.to_thread(models.step_gate.held.wait, TIMEOUT), TIMEOUT)
            await e.layer.send("ignis.engine", AbortRequest(aborted.request_id).to_message())
            models.step_gate.open()
            _, last = await e.outcome(aborted)
            assert last["type"] == "engine.finished" and last["finish_reason"] == "abort"
            await e.status()
        sent = [m for m, _ in layer.kept]
        assert any(m.get("logprobs") for m in sent)  # nested data went out
        assert sum(m["type"] == "engine.heartbeat" for m in sent) >= 2  # beats too, each its own
        for message, then in layer.kept:
            assert message == then, message  # unchanged since it was handed to the layer
        owner: dict[int, int] = {}
        for i, message in enumerate(sent):
            for c in containers(message, []):
                assert owner.setdefault(id(c), i) == i, f"messages {owner[id(c)]} and {i} share {c!r}"

    run(scenario)
