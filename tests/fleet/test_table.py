"""The fleet's routing table (apps/core/fleet.py) and what the front end does when a worker goes
(apps/core/engine_state.py), fed with heartbeats over the in-memory layer: where requests go,
which are sent again and which end, and which worker a switch takes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from channels.layers import InMemoryChannelLayer
from django.conf import settings

from apps.core import engine_client, engine_state
from apps.core.fleet import Fleet
from engine.messages import STATUS_GROUP, AddRequest, EngineHeartbeat, RequestFinished, worker_channel

TIMEOUT = 10.0


def beat(worker_id: str, model: str, *, busy: int = 0, kv: int = 100, state: str = "serving", **kw) -> EngineHeartbeat:
    status = {"status": state, "model": model, "path": f"/models/{model}", "idle_seconds": kw.pop("idle", 0.0)}
    return EngineHeartbeat(
        engine_id=kw.pop("engine_id", f"e-{worker_id}"),
        heartbeat=0.1,
        status=status,
        worker_id=worker_id,
        channel=worker_channel(worker_id),
        model=model,
        lanes_busy=busy,
        lanes_total=4,
        kv_pages_free=kv,
        **kw,
    )


def table(*beats: EngineHeartbeat) -> Fleet:
    fleet = Fleet()
    for b in beats:
        fleet.take(b, time.monotonic())
    return fleet


def test_a_request_goes_to_a_worker_of_its_model_the_least_loaded_then_the_least_recently_picked():
    fleet = table(beat("a1", "m-a", busy=2), beat("a2", "m-a", busy=1), beat("b", "m-b"))
    assert fleet.route("m-a").name == "a2"  # fewer busy lanes; never b, idle as it is
    assert fleet.route("m-b").name == "b"
    assert fleet.route("m-c") is None
    even = table(beat("a1", "m-a"), beat("a2", "m-a"), beat("b", "m-b"))
    assert sorted(even.route("m-a").name for _ in range(4)) == ["a1", "a1", "a2", "a2"]  # spread
    roomier = table(beat("a1", "m-a", kv=10), beat("a2", "m-a", kv=90))
    assert roomier.route("m-a").name == "a2"  # lanes tie: the most KV free


def test_draining_switching_and_leaving_workers_get_nothing_new():
    fleet = table(beat("a1", "m-a", draining=True), beat("a2", "m-a", state="switching"), beat("a3", "m-a"))
    assert {fleet.route("m-a").name for _ in range(3)} == {"a3"}
    fleet.take(beat("a3", "m-a", leaving=True), time.monotonic())
    assert "a3" not in {w.name for w in fleet.live()} and fleet.route("m-a") is None


def test_requests_sent_since_a_beat_count_as_load():
    fleet = table(beat("a1", "m-a"), beat("a2", "m-a"))
    now = time.monotonic()
    for i in range(2):  # the beats cannot know these yet
        fleet.record(f"r{i}", worker_channel("a1"), {"reply_channel": "x", "model": "m-a"}, now)
    assert [fleet.route("m-a").name for _ in range(1)] == ["a2"]
    fleet.take(beat("a1", "m-a", busy=2, running_request_ids=["r0", "r1"]), now)  # a beat that knows them
    assert fleet.workers[worker_channel("a1")].sent_since_beat == 0 and fleet.route("m-a").name == "a2"


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("idle", "a2"), ("least_loaded", "b"), ("none", None)],
)
def test_the_fleet_policy_picks_the_worker_an_implicit_switch_takes(policy, expected):
    # a1 is busy; a2 idle and its model is served by a1 too (switching it strands nothing); b idle,
    # the only worker of m-b, with the most KV free.
    fleet = table(beat("a1", "m-a", busy=3), beat("a2", "m-a", busy=0, kv=10), beat("b", "m-b", kv=200))
    picked = fleet.switch_candidate(policy, "m-c")
    assert (picked.name if picked else None) == expected


@pytest.fixture
def front_end(monkeypatch):
    layer = InMemoryChannelLayer()
    cache = engine_state.EngineStateCache()
    monkeypatch.setattr(engine_state, "CACHE", cache)
    monkeypatch.setattr(engine_state, "get_channel_layer", lambda: layer)
    monkeypatch.setattr(engine_client, "get_channel_layer", lambda: layer)
    monkeypatch.setattr(engine_state, "STATUS_HOOKS", [])
    monkeypatch.setitem(settings.IGNIS, "server.worker_timeout", 0.4)
    return layer, cache


async def until(probe, message: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {message}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def listening(cache):
    """The front end's heartbeat listener for the block, running and joined to the status group."""
    listener = asyncio.create_task(engine_state.engine_state_listen())
    try:
        await until(lambda: cache.listening, "the listener")
        await asyncio.sleep(0)  # let it join the group
        yield
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener


def test_a_silent_worker_leaves_its_queued_requests_go_to_a_live_one_and_its_streams_end(front_end):
    layer, cache = front_end

    async def scenario():
        async with listening(cache):
            for b in (beat("a1", "m-a"), beat("a2", "m-a", busy=3), beat("b", "m-b")):
                await layer.group_send(STATUS_GROUP, b.to_message())
            await until(lambda: len(cache.workers) == 3, "three workers")
            adds = {}
            for rid, model in (("run", "m-a"), ("queued", "m-a"), ("lonely", "m-b"), ("lonely-run", "m-b")):
                adds[rid] = AddRequest(rid, await layer.new_channel(), [1, 2, 3], 8, model=model)
                await engine_client.request_submit(adds[rid])
            assert {rid: s.channel for rid, s in cache.sent.items()} == {
                "run": worker_channel("a1"),
                "queued": worker_channel("a1"),  # a2 has three lanes busy
                "lonely": worker_channel("b"),
                "lonely-run": worker_channel("b"),
            }
            for channel, n in ((worker_channel("a1"), 2), (worker_channel("b"), 2)):
                for _ in range(n):
                    await layer.receive(channel)
            # a1 and b say what they hold, then fall silent; a2 keeps beating.
            await layer.group_send(
                STATUS_GROUP,
                beat("a1", "m-a", running_request_ids=["run"], waiting_request_ids=["queued"]).to_message(),
            )
            await layer.group_send(
                STATUS_GROUP,
                beat("b", "m-b", running_request_ids=["lonely-run"], waiting_request_ids=["lonely"]).to_message(),
            )

            async def keep_a2():
                while True:
                    await layer.group_send(STATUS_GROUP, beat("a2", "m-a", busy=3).to_message())
                    await asyncio.sleep(0.05)

            alive = asyncio.create_task(keep_a2())
            try:
                resent = await asyncio.wait_for(layer.receive(worker_channel("a2")), TIMEOUT)
                assert (resent["type"], resent["request_id"]) == ("engine.add", "queued")
                assert resent["reply_channel"] == adds["queued"].reply_channel  # its client hears a2 now
                failed = await asyncio.wait_for(layer.receive(adds["run"].reply_channel), TIMEOUT)
                assert (failed["type"], failed["code"]) == ("engine.failed", "engine_error")
                failed = await asyncio.wait_for(layer.receive(adds["lonely"].reply_channel), TIMEOUT)
                assert (failed["code"], failed["status"], failed["retry_after"]) == (
                    "engine_unavailable",
                    503,
                    engine_state.RETRY_AFTER,
                )
                failed = await asyncio.wait_for(layer.receive(adds["lonely-run"].reply_channel), TIMEOUT)
                assert failed["code"] == "engine_error"
                assert [w.name for w in cache.live()] == ["a2"]
                assert cache.sent["queued"].channel == worker_channel("a2")
                await engine_client.request_abort("queued")  # the abort follows it to a2
                assert (await asyncio.wait_for(layer.receive(worker_channel("a2")), TIMEOUT))["type"] == (
                    "engine.abort"
                )
            finally:
                alive.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 3 * TIMEOUT))


def test_a_worker_restarted_under_its_id_ends_what_its_previous_engine_held(front_end):
    layer, cache = front_end

    async def scenario():
        async with listening(cache):
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a").to_message())
            await until(lambda: cache.workers, "a worker")
            add = AddRequest("r1", await layer.new_channel(), [1, 2], 8, model="m-a")
            await engine_client.request_submit(add)
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a", running_request_ids=["r1"]).to_message())
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a", engine_id="e-a1-second").to_message())
            failed = await asyncio.wait_for(layer.receive(add.reply_channel), TIMEOUT)
            assert (failed["type"], failed["code"]) == ("engine.failed", "engine_error")
            assert [w.engine_id for w in cache.live()] == ["e-a1-second"]

    asyncio.run(asyncio.wait_for(scenario(), 3 * TIMEOUT))


def test_a_leaving_worker_s_open_requests_end_with_engine_error_none_sent_again(front_end):
    """The net under the drain: a worker's leaving beat says it answered all it held, but a
    request this front end sent it and never heard the end of (the stream lost at stop 22, its
    last beats listing it running, its leaving beat nothing) ends here with engine_error, once
    server.worker_timeout has passed; a queued one is not sent again (the worker answered it, or
    may have begun it). One whose consumer reads its last message in the meantime (it was queued
    behind the stream's tokens) is left alone."""
    layer, cache = front_end

    async def scenario():
        async with listening(cache):
            for b in (beat("a1", "m-a"), beat("a2", "m-a", busy=4)):  # a2's lanes all busy: a1 gets them
                await layer.group_send(STATUS_GROUP, b.to_message())
            await until(lambda: len(cache.workers) == 2, "two workers")
            ids = ("run", "queued", "done", "read-late")
            adds = {rid: AddRequest(rid, await layer.new_channel(), [1, 2], 8, model="m-a") for rid in ids}
            for add in adds.values():
                await engine_client.request_submit(add)
            assert {s.channel for s in cache.sent.values()} == {worker_channel("a1")}
            held = beat("a1", "m-a", draining=True, running_request_ids=list(ids[:3]), waiting_request_ids=["queued"])
            await layer.group_send(STATUS_GROUP, held.to_message())
            # "done" finished: its consumer heard engine.finished (before any beat could say so).
            engine_client.reply_heard(RequestFinished("done", "length", 2, 8).to_message())
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a", leaving=True).to_message())
            await until(lambda: worker_channel("a1") not in cache.workers, "a1 out of the routing")
            assert [w.name for w in cache.live()] == ["a2"] and cache.route("m-a").name == "a2"
            engine_client.reply_heard(RequestFinished("read-late", "length", 2, 8).to_message())
            for rid in ("run", "queued"):
                failed = await asyncio.wait_for(layer.receive(adds[rid].reply_channel), TIMEOUT)
                assert (failed["type"], failed["code"]) == ("engine.failed", "engine_error"), failed
            assert cache.sent == {} and cache.departed == {}
            await layer.group_send(STATUS_GROUP, beat("a2", "m-a", busy=2).to_message())  # the listener is past it
            await until(lambda: cache.workers[worker_channel("a2")].lanes_busy == 2, "a2's next beat")
            for add in adds.values():  # nothing else: no second end, none for the finished, nothing sent on to a2
                assert layer.channels.get(add.reply_channel) is None or layer.channels[add.reply_channel].empty()
            assert layer.channels.get(worker_channel("a2")) is None or layer.channels[worker_channel("a2")].empty()

    asyncio.run(asyncio.wait_for(scenario(), 3 * TIMEOUT))


def test_a_worker_back_under_its_id_before_the_net_falls_ends_what_it_left_open(front_end):
    layer, cache = front_end

    async def scenario():
        async with listening(cache):
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a").to_message())
            await until(lambda: cache.workers, "a worker")
            add = AddRequest("r1", await layer.new_channel(), [1, 2], 8, model="m-a")
            await engine_client.request_submit(add)
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a", running_request_ids=["r1"]).to_message())
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a", leaving=True).to_message())
            await layer.group_send(STATUS_GROUP, beat("a1", "m-a", engine_id="e-a1-second").to_message())
            failed = await asyncio.wait_for(layer.receive(add.reply_channel), TIMEOUT)
            assert (failed["type"], failed["code"]) == ("engine.failed", "engine_error")
            assert [w.engine_id for w in cache.live()] == ["e-a1-second"] and cache.departed == {}

    asyncio.run(asyncio.wait_for(scenario(), 3 * TIMEOUT))


def test_a_switch_goes_to_the_named_worker_one_serving_the_target_or_the_policy_pick(monkeypatch):
    from apps.core.errors import ModelNotFound, ModelSwitchFailed
    from apps.models.switching import switch_worker

    fleet = table(beat("a1", "m-a", busy=3), beat("a2", "m-a"), beat("b", "m-b"))
    fleet.listening = True
    monkeypatch.setattr(engine_state, "CACHE", fleet)
    monkeypatch.setitem(settings.IGNIS, "switch.fleet_policy", "idle")
    assert switch_worker(target_id="m-c", trigger="explicit", worker="b").name == "b"
    with pytest.raises(ModelNotFound):
        switch_worker(target_id="m-c", trigger="explicit", worker="nobody")
    assert switch_worker(target_id="m-b", trigger="implicit").name == "b"  # serves it: answers unchanged
    assert switch_worker(target_id="m-c", trigger="implicit").name == "a2"  # idle, and m-a keeps a1
    monkeypatch.setitem(settings.IGNIS, "switch.fleet_policy", "none")
    with pytest.raises(ModelSwitchFailed):
        switch_worker(target_id="m-c", trigger="implicit")


def test_a_fleet_of_one_always_gets_the_switch_the_engine_answers_409_itself():
    fleet = table(beat("only", "m-a", state="switching"))
    assert fleet.switch_candidate("none", "m-b").name == "only"


def test_logit_bias_is_checked_against_the_vocabulary_of_the_model_the_request_goes_to(monkeypatch):
    from types import SimpleNamespace

    from apps.api.validation import parse_chat_request
    from apps.core.errors import InvalidRequest
    from apps.models import services

    fleet = table(beat("a1", "m-a"), beat("b", "m-b"))
    fleet.listening = True
    monkeypatch.setattr(engine_state, "CACHE", fleet)
    monkeypatch.setitem(settings.IGNIS, "model.id", "m-a")
    for model, vocab in (("m-a", 100), ("m-b", 200)):  # their tokenizers, as the front end has them
        served = services.served_model_for(served_id=model, path=f"/models/{model}")
        monkeypatch.setitem(served.__dict__, "tokenizer", SimpleNamespace(vocab_size=vocab))
    monkeypatch.setattr(
        services, "served_model", lambda: services.served_model_for(served_id="m-a", path="/models/m-a")
    )

    def bias(model: str | None, token: int) -> list:
        body = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {str(token): 1}}
        return parse_chat_request({**body, **({"model": model} if model else {})}).sampling["logit_bias"]

    assert bias("m-b", 150) == [[150, 1.0]]  # m-b's 200 tokens, not the default model's 100
    assert bias("m-b@agent", 199) == [[199, 1.0]]
    for model, token in (("m-a", 150), (None, 150), ("m-b", 200), ("m-zzz", 150)):  # no name, unknown: the default's
        with pytest.raises(InvalidRequest) as err:
            bias(model, token)
        assert err.value.param == f"logit_bias.{token}"


@pytest.mark.django_db(transaction=True)
def test_a_reload_patch_sends_the_worker_only_what_it_changes(monkeypatch):
    """A fleet's worker runs its own flags (its backend, lanes, budgets): a PATCH of a reload key
    reloads it with that key changed, not with this front end's whole configuration."""
    from pathlib import Path

    from asgiref.sync import async_to_sync

    from apps.models import config_service, switching
    from apps.models.services import SwitchTarget

    asked = []

    async def model_switch(*, target, trigger, config, wait):
        asked.append((target.served_id, trigger, config))
        return {"outcome": "switched", "reason": "", "seconds": 0.1}

    monkeypatch.setattr(switching, "model_switch", model_switch)
    monkeypatch.setattr(config_service, "_reload_target", lambda values: SwitchTarget("m-a", Path("/models/m-a")))
    monkeypatch.setattr(config_service, "_sources", dict(config_service._sources))
    for key, value in (("model.max_context", 4096), ("model.backend", "cpu"), ("spec.decode_lanes", 8)):
        monkeypatch.setitem(settings.IGNIS, key, value)
    result = async_to_sync(config_service.config_update)(patch={"model.max_context": 2048, "spec.decode_lanes": 8})
    assert result["changed"] == ["model.max_context"] and result["reload"]["outcome"] == "switched"
    assert asked == [("m-a", "config", {"max_context": 2048})]  # not the front end's backend, lanes, ...
