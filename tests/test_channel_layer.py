"""The embedded layer (ignis_site/channel_layer.py): two event loops on two threads, one layer.

A ``LoopThread`` is a second event loop on its own thread, as the engine's is in
``manage.py serve``; the test's own loop plays Daphne's. Every wait is bounded by
TIMEOUT (a lost wake-up fails the test instead of hanging it), and nothing waits on
the clock: expiry runs on a clock the test moves.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest
from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from django.conf import settings

from ignis_site.channel_layer import CrossLoopChannelLayer, _Channel

TIMEOUT = 10.0


def on_a_loop(test):
    """Run an async test on a fresh event loop of the test's thread (this layer's stand-in for Daphne's)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 6 * TIMEOUT))

    return run


class LoopThread:
    """An event loop running on a thread of its own; ``run(coro)`` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-other-loop", daemon=True)
        self.thread.start()

    async def run(self, coro):
        return await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop)), TIMEOUT)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


@pytest.fixture
def other():
    lt = LoopThread()
    yield lt
    lt.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def parked(layer: CrossLoopChannelLayer, channel: str, n: int = 1) -> None:
    """Until ``n`` receivers wait on ``channel`` (each receive parks within a loop turn of starting)."""
    for _ in range(100):
        ch = layer.channels.get(channel)
        if ch is not None and len(ch.waiters) >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{n} receivers never parked on {channel}")


def test_embedded_settings_use_it():
    assert not settings.REDIS_URL
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == "ignis_site.channel_layer.CrossLoopChannelLayer"
    assert isinstance(get_channel_layer(), CrossLoopChannelLayer)


@on_a_loop
async def test_a_send_from_another_loop_wakes_a_parked_receiver(other):
    layer = CrossLoopChannelLayer()
    got = asyncio.ensure_future(layer.receive("reply.inmemory!abc"))
    await parked(layer, "reply.inmemory!abc")
    await other.run(layer.send("reply.inmemory!abc", {"type": "engine.tokens", "token_ids": [1, 2]}))
    assert await asyncio.wait_for(got, TIMEOUT) == {"type": "engine.tokens", "token_ids": [1, 2]}
    assert layer.channels == {}  # an emptied channel with nobody waiting is forgotten


@on_a_loop
async def test_a_receiver_on_another_loop_gets_what_this_loop_sends(other):
    layer = CrossLoopChannelLayer()
    got = asyncio.run_coroutine_threadsafe(layer.receive("ignis.engine"), other.loop)
    for _ in range(100):  # until it parks over there
        if layer.channels.get("ignis.engine"):
            break
        await asyncio.sleep(0.001)
    await layer.send("ignis.engine", {"type": "engine.add"})
    assert await asyncio.wait_for(asyncio.wrap_future(got), TIMEOUT) == {"type": "engine.add"}


@on_a_loop
async def test_a_message_is_a_copy():
    layer = CrossLoopChannelLayer()
    msg = {"type": "x", "ids": [1], "items": [{"top": [[1, -0.5]]}], "raw": b"\x00", "pair": (1, [2])}
    await layer.send("c", msg)
    msg["ids"].append(2)
    msg["items"][0]["top"][0].append(9)
    msg["pair"][1].append(3)
    got = await layer.receive("c")
    assert got == {"type": "x", "ids": [1], "items": [{"top": [[1, -0.5]]}], "raw": b"\x00", "pair": (1, [2])}


@on_a_loop
async def test_a_long_message_is_a_copy_too():
    """Long flat lists (a prompt's ids) are copied whole, long lists holding containers element-wise."""
    layer = CrossLoopChannelLayer()
    ids, tops = list(range(4000)), [[i, -0.5] for i in range(100)]
    mixed = [*range(50), {"k": [1]}, *range(50)]
    await layer.send("c", {"type": "x", "ids": ids, "tops": tops, "mixed": mixed})
    ids.append(-1)
    tops[99].append(9)
    mixed[50]["k"].append(2)
    got = await layer.receive("c")
    assert got["ids"] == list(range(4000)) and got["tops"] == [[i, -0.5] for i in range(100)]
    assert got["mixed"] == [*range(50), {"k": [1]}, *range(50)]


@on_a_loop
async def test_order_holds_both_ways_under_load(other):
    """The engine's loop and this one stream at each other at once: nothing lost, nothing reordered."""
    layer = CrossLoopChannelLayer(capacity=10_000)
    n = 2000

    async def pump(to: str, frm: str) -> list[int]:
        async def sender():
            for i in range(n):
                await layer.send(to, {"type": "t", "i": i})
                if i % 50 == 0:
                    await asyncio.sleep(0)

        task = asyncio.ensure_future(sender())
        got = [(await layer.receive(frm))["i"] for _ in range(n)]
        await task
        return got

    theirs = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(pump("to-here", "to-there"), other.loop))
    ours = await asyncio.wait_for(pump("to-there", "to-here"), TIMEOUT)
    assert ours == list(range(n))
    assert await asyncio.wait_for(theirs, TIMEOUT) == list(range(n))


@on_a_loop
async def test_ping_pong_across_loops_never_loses_a_wake_up(other):
    """Every message is received by a parked receiver woken from the other thread."""
    layer = CrossLoopChannelLayer()

    async def echo():
        for _ in range(500):
            msg = await layer.receive("ping")
            await layer.send("pong", {"type": "pong", "i": msg["i"]})

    echoing = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(echo(), other.loop))
    for i in range(500):
        await layer.send("ping", {"type": "ping", "i": i})
        assert (await asyncio.wait_for(layer.receive("pong"), TIMEOUT))["i"] == i
    await asyncio.wait_for(echoing, TIMEOUT)


@on_a_loop
async def test_groups_reach_members_on_both_loops(other):
    layer = CrossLoopChannelLayer()
    await layer.group_add("ignis.status", "here")
    await other.run(layer.group_add("ignis.status", "there"))
    there = asyncio.run_coroutine_threadsafe(layer.receive("there"), other.loop)
    await other.run(layer.group_send("ignis.status", {"type": "engine.heartbeat", "n": 1}))
    assert await asyncio.wait_for(layer.receive("here"), TIMEOUT) == {"type": "engine.heartbeat", "n": 1}
    assert await asyncio.wait_for(asyncio.wrap_future(there), TIMEOUT) == {"type": "engine.heartbeat", "n": 1}
    await layer.group_discard("ignis.status", "there")
    await layer.group_send("ignis.status", {"type": "engine.heartbeat", "n": 2})
    assert (await layer.receive("here"))["n"] == 2
    assert "there" not in layer.channels
    await layer.group_discard("ignis.status", "here")
    assert layer.groups == {}


@on_a_loop
async def test_capacity_raises_channel_full_and_a_full_group_member_is_skipped():
    layer = CrossLoopChannelLayer(capacity=2, channel_capacity={"small.*": 1})
    await layer.send("big", {"type": "a"})
    await layer.send("big", {"type": "b"})
    with pytest.raises(ChannelFull):
        await layer.send("big", {"type": "c"})
    await layer.send("small.one", {"type": "a"})
    with pytest.raises(ChannelFull):
        await layer.send("small.one", {"type": "b"})
    await layer.group_add("g", "small.one")
    await layer.group_add("g", "other")
    await layer.group_send("g", {"type": "g"})  # small.one is full: it misses this one, no error
    assert (await layer.receive("other"))["type"] == "g"
    assert (await layer.receive("small.one"))["type"] == "a"
    assert (await layer.receive("big"))["type"] == "a"
    await layer.send("big", {"type": "c"})  # room again


@on_a_loop
async def test_an_expired_message_is_dropped_and_its_channel_leaves_its_groups():
    layer = CrossLoopChannelLayer(expiry=60, group_expiry=3600)
    layer.clock = clock = Clock()
    await layer.group_add("g", "gone")
    await layer.group_add("g", "alive")
    await layer.send("gone", {"type": "old"})
    clock.now += 30
    await layer.send("alive", {"type": "fresh"})
    clock.now += 31  # "gone"'s message is past its 60 s, "alive"'s is not
    assert await layer.receive("alive") == {"type": "fresh"}
    assert "gone" not in layer.channels and set(layer.groups["g"]) == {"alive"}
    clock.now += 3600  # and group memberships expire too
    await layer.group_send("g", {"type": "late"})
    assert layer.groups["g"] == {} and "alive" not in layer.channels


@on_a_loop
async def test_a_receiver_cancelled_after_its_wake_up_passes_the_message_on():
    """A consumer's receive task is cancelled (its stream ended) just as a message woke it:
    the message waits for the next receive, and a second waiting receiver gets it."""
    layer = CrossLoopChannelLayer()
    first = asyncio.ensure_future(layer.receive("c"))
    second = asyncio.ensure_future(layer.receive("c"))
    await parked(layer, "c", 2)
    await layer.send("c", {"type": "m"})  # wakes ``first`` ...
    first.cancel()  # ... which is cancelled before it runs again
    assert await asyncio.wait_for(second, TIMEOUT) == {"type": "m"}
    with pytest.raises(asyncio.CancelledError):
        await first
    assert layer.channels == {}

    lone = asyncio.ensure_future(layer.receive("d"))
    await parked(layer, "d")
    await layer.send("d", {"type": "m"})
    lone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lone
    assert await asyncio.wait_for(layer.receive("d"), TIMEOUT) == {"type": "m"}  # still there


@on_a_loop
async def test_a_receiver_whose_loop_closed_is_skipped():
    layer = CrossLoopChannelLayer()
    dead = asyncio.new_event_loop()
    layer.channels["c"] = ch = _Channel()
    ch.waiters.append((dead, dead.create_future()))
    dead.close()
    here = asyncio.ensure_future(layer.receive("c"))
    await parked(layer, "c", 2)
    await layer.send("c", {"type": "m"})
    assert await asyncio.wait_for(here, TIMEOUT) == {"type": "m"}


@on_a_loop
async def test_flush_keeps_parked_receivers():
    layer = CrossLoopChannelLayer()
    await layer.send("a", {"type": "old"})
    await layer.group_add("g", "a")
    waiting = asyncio.ensure_future(layer.receive("b"))
    await parked(layer, "b")
    await layer.flush()
    assert layer.groups == {} and "a" not in layer.channels
    await layer.send("b", {"type": "new"})
    assert await asyncio.wait_for(waiting, TIMEOUT) == {"type": "new"}


@on_a_loop
async def test_new_channel_names_are_valid_and_distinct():
    layer = CrossLoopChannelLayer()
    names = {await layer.new_channel() for _ in range(50)}
    assert len(names) == 50
    for name in names:
        assert layer.require_valid_channel_name(name)
