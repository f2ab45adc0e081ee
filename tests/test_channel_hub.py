"""ignis_site.channel_hub: the Channels layer between the processes of serve --server-front-ends.

Two ``HubChannelLayer`` instances stand for two processes (each has its own connection and
reader thread; nothing is shared but the hub), on real Unix sockets."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ignis_site.channel_hub import ChannelHub, HubChannelLayer
from tests.helpers import wait_for


@pytest.fixture
def hub(tmp_path):
    hub = ChannelHub(tmp_path / "hub.sock", capacity=3, expiry=60, retain=("status",))
    hub.start()
    yield hub
    hub.stop()


def layers(hub, n=2):
    return [HubChannelLayer(path=hub.path, expiry=60, capacity=100) for _ in range(n)]


async def receive(layer, channel, timeout=5.0):
    return await asyncio.wait_for(layer.receive(channel), timeout)


def run(coro):
    return asyncio.run(coro)


def joined(hub, group, channel, member=True):
    """Until the hub has taken (or dropped) ``channel`` in ``group``: frames of two connections race."""
    wait_for(lambda: (channel in hub.groups.get(group, {})) == member, 5, 0.01, f"{channel} in {group}: {member}")


def test_a_message_crosses_to_the_process_that_listens(hub):
    a, b = layers(hub)

    async def go():
        channel = await b.new_channel()
        receiving = asyncio.ensure_future(receive(b, channel))  # listening before or after: the same
        await a.send(channel, {"type": "engine.tokens", "token_ids": [1, 2, 3], "text": "é"})
        return await receiving

    assert run(go()) == {"type": "engine.tokens", "token_ids": [1, 2, 3], "text": "é"}
    a.close()
    b.close()


def test_a_message_sent_before_anyone_listens_waits_at_the_hub(hub):
    a, b = layers(hub)

    async def go():
        await a.send("ignis.engine", {"type": "engine.add", "n": 1})
        await a.send("ignis.engine", {"type": "engine.add", "n": 2})
        return [await receive(b, "ignis.engine"), await receive(b, "ignis.engine")]

    assert [m["n"] for m in run(go())] == [1, 2]  # in order


def test_a_channel_nobody_reads_keeps_only_its_capacity(hub):
    a, b = layers(hub)

    async def go():
        for n in range(5):
            await a.send("nobody.yet", {"type": "x", "n": n})
        first = [await receive(b, "nobody.yet") for _ in range(3)]
        with pytest.raises(asyncio.TimeoutError):
            await receive(b, "nobody.yet", timeout=0.3)
        return first

    assert [m["n"] for m in run(go())] == [2, 3, 4]  # the oldest two went
    assert hub.dropped == 2


def test_a_send_to_a_channel_of_this_process_stays_here(hub):
    (a,) = layers(hub, 1)

    async def go():
        channel = await a.new_channel()
        receiving = asyncio.ensure_future(receive(a, channel))
        while channel not in a._listening:  # the receive has started (and said so to the hub)
            await asyncio.sleep(0)
        hub.stop()  # the hub is gone: only a local delivery can still arrive
        await a.send(channel, {"type": "timer"})
        return await receiving

    assert run(go()) == {"type": "timer"}


def test_groups_reach_every_member_and_a_retained_group_greets_a_newcomer(hub):
    a, b, c = layers(hub, 3)

    async def go():
        await b.group_add("status", "b.status")
        await b.group_add("other", "b.other")
        joined(hub, "other", "b.other")
        await a.group_send("status", {"type": "beat", "n": 1})
        await a.group_send("other", {"type": "x"})
        got_b = await receive(b, "b.status")
        await receive(b, "b.other")
        await c.group_add("status", "c.status")  # joins after the beat: gets the last one now
        await c.group_add("other", "c.other")  # not retained: nothing old
        got_c = await receive(c, "c.status")
        with pytest.raises(asyncio.TimeoutError):
            await receive(c, "c.other", timeout=0.3)
        await b.group_discard("status", "b.status")
        joined(hub, "status", "b.status", member=False)
        await a.group_send("status", {"type": "beat", "n": 2})
        got_c2 = await receive(c, "c.status")
        with pytest.raises(asyncio.TimeoutError):
            await receive(b, "b.status", timeout=0.3)
        return got_b, got_c, got_c2

    got_b, got_c, got_c2 = run(go())
    assert got_b == got_c == {"type": "beat", "n": 1}
    assert got_c2 == {"type": "beat", "n": 2}


def test_a_process_that_goes_away_takes_its_listens_and_memberships(hub):
    a, b = layers(hub)

    async def go():
        receiving = asyncio.ensure_future(receive(b, "b.own"))
        await b.group_add("g", "b.own")
        joined(hub, "g", "b.own")
        while "b.own" not in b._listening:  # the receive has started (and said so to the hub)
            await asyncio.sleep(0)
        wait_for(lambda: "b.own" in hub.listeners, 5, 0.01, "b's listen at the hub")
        receiving.cancel()
        b.close()

    run(go())
    wait_for(lambda: "b.own" not in hub.listeners, 5, 0.01, "the hub to forget b's listen")
    assert "g" not in hub.groups  # forgotten in the same step as the listen
    run(a.send("b.own", {"type": "later"}))  # waits at the hub for a new listener
    wait_for(
        lambda: len(hub.waiting.get("b.own", ())), 5, 0.01, "the message to wait at the hub", until=lambda n: n == 1
    )


def test_a_lost_hub_is_reconnected_and_listens_are_said_again(tmp_path):
    path = tmp_path / "hub.sock"
    first = ChannelHub(path)
    first.start()
    a, b = HubChannelLayer(path=str(path), reconnect=0.05), HubChannelLayer(path=str(path), reconnect=0.05)
    got = []

    async def listen_then_wait():
        got.append(await receive(b, "b.own", timeout=10))

    done = threading.Event()

    def in_b():
        run(listen_then_wait())
        done.set()

    thread = threading.Thread(target=in_b)
    thread.start()
    for _ in range(100):
        if "b.own" in first.listeners:
            break
        threading.Event().wait(0.02)
    first.stop()  # b's reader sees the end and reconnects to the next hub on the same path
    second = ChannelHub(path)
    second.start()
    try:
        for _ in range(200):
            if "b.own" in second.listeners:
                break
            threading.Event().wait(0.02)
        assert "b.own" in second.listeners
        run(a.send("b.own", {"type": "after"}))
        assert done.wait(10)
        assert got == [{"type": "after"}]
    finally:
        thread.join(10)
        second.stop()
        a.close()
        b.close()
