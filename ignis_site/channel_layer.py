"""The embedded mode's Channels layer: in-process, and safe across threads and event loops.

Embedded, the engine loop runs on a thread and event loop of its own while Daphne
serves HTTP on the main thread's loop (apps/models/management/commands/serve.py).
Channels' ``InMemoryChannelLayer`` keeps each channel as an ``asyncio.Queue``, which
belongs to the loop that first waits on it: a send from the other loop would wake
the receiver on the wrong loop (or never). Here a channel is a plain deque under one
lock, and a receiver waits on a future of its own loop, which a sender on any thread
wakes with ``call_soon_threadsafe``. A send never waits for the receiver's loop: the
engine puts a round's tokens on the consumers' channels and goes on with the next
round while Daphne writes them out.

Everything else is InMemoryChannelLayer's behaviour, kept so the layer can stand in
for it: ``capacity`` / ``channel_capacity`` (``ChannelFull`` on a full channel),
``expiry`` (a message not received in time is dropped, and its channel leaves every
group), ``group_expiry``, groups (``group_send`` skips full members), ``flush`` and
``new_channel``'s names. Scaled mode uses channels_redis instead (ignis_site/settings.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from copy import deepcopy

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer


class _Channel:
    """One channel's messages (expiry time, message) and the receivers waiting on it (loop, future)."""

    __slots__ = ("messages", "waiters")

    def __init__(self) -> None:
        self.messages: deque[tuple[float, dict]] = deque()
        self.waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()


_IMMUTABLE = (str, int, float, bool, bytes, type(None))
_ATOMS = frozenset(_IMMUTABLE)


def _copy(value):
    """A copy of a message as deep as ``deepcopy``'s, at a third of its cost for the plain data the
    layer carries (dicts, lists, strings, numbers; what msgpack carries over Redis): an engine
    round sends one message per stream, on the engine's side of the seam, between two rounds."""
    kind = type(value)
    if kind is dict:
        return {k: _copy(v) for k, v in value.items()}
    if kind is list:
        # a long flat list (a prompt's token ids) in one copy once its element types are seen to be plain
        # (in C: 32,000 ids 3.6 -> 0.9 ms on the 2-core VM, on the front end's loop as a request goes in)
        if len(value) > 32 and _ATOMS.issuperset(map(type, value)):
            return value.copy()
        return [_copy(v) for v in value]
    if kind in _IMMUTABLE:
        return value
    if kind is tuple:
        return tuple(_copy(v) for v in value)
    return deepcopy(value)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a sender outside any loop
        return None


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class CrossLoopChannelLayer(InMemoryChannelLayer):
    """InMemoryChannelLayer whose senders and receivers may be on different threads and loops.

    A receiver first takes a waiting message under the lock; with none it parks a
    future of its own loop on the channel. A send appends under the lock and wakes the
    first parked receiver on that receiver's loop. A woken receiver takes the message
    under the lock again, so a receiver cancelled between its wake-up and its turn
    loses nothing: the message stays queued and the next receiver is woken for it.
    """

    clock = staticmethod(time.time)  # expiry times; a test may set another clock on the instance

    def __init__(self, expiry=60, group_expiry=86400, capacity=100, channel_capacity=None, **kwargs):
        super().__init__(
            expiry=expiry, group_expiry=group_expiry, capacity=capacity, channel_capacity=channel_capacity, **kwargs
        )
        # Globs to regexes, as channels_redis does (InMemoryChannelLayer keeps the dict, which get_capacity
        # cannot read).
        self.channel_capacity = self.compile_capacities(channel_capacity or {})
        self._lock = threading.Lock()
        self.channels: dict[str, _Channel] = {}

    async def send(self, channel: str, message: dict) -> None:
        """Put ``message`` on ``channel`` (a copy, as InMemoryChannelLayer keeps); ChannelFull when full.
        Never waits: the receiver's loop is woken, not waited for."""
        assert isinstance(message, dict), "message is not a dict"
        self.require_valid_channel_name(channel)
        assert "__asgi_channel__" not in message
        self._put(channel, _copy(message))

    def _put(self, channel: str, message: dict) -> None:
        with self._lock:
            ch = self.channels.get(channel)
            if ch is None:
                ch = self.channels[channel] = _Channel()
            if len(ch.messages) >= self.get_capacity(channel):
                raise ChannelFull(channel)
            ch.messages.append((self.clock() + self.expiry, message))
            self._wake_one(ch)

    def _wake_one(self, ch: _Channel) -> None:
        """Wake the first parked receiver whose loop still runs (under the lock)."""
        while ch.waiters:
            loop, future = ch.waiters.popleft()
            if future.done():
                continue
            try:
                if loop is _running_loop():
                    loop.call_soon(_wake, future)
                else:
                    loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # its loop is closed: that receiver is gone
                continue
            return

    async def receive(self, channel: str) -> dict:
        """The first message on ``channel``, waiting for one on the caller's own loop."""
        self.require_valid_channel_name(channel)
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                self._clean_expired_locked()
                ch = self.channels.get(channel)
                if ch is not None and ch.messages:
                    _, message = ch.messages.popleft()
                    if ch.messages:
                        self._wake_one(ch)  # more for another receiver of this channel, if any waits
                    elif not ch.waiters:
                        del self.channels[channel]
                    return message
                if ch is None:
                    ch = self.channels[channel] = _Channel()
                future = loop.create_future()
                entry = (loop, future)
                ch.waiters.append(entry)
            try:
                await future
            except BaseException:  # cancelled, even just after a sender woke it
                self._abandon(channel, ch, entry)
                raise

    def _abandon(self, channel: str, ch: _Channel, entry) -> None:
        """A parked receiver was cancelled: off the channel; a wake-up meant for it goes to the next."""
        with self._lock:
            try:
                ch.waiters.remove(entry)
            except ValueError:  # a sender had popped it to wake it: pass that on
                if ch.messages:
                    self._wake_one(ch)
            if not ch.messages and not ch.waiters and self.channels.get(channel) is ch:
                del self.channels[channel]

    # -- expiry ------------------------------------------------------------------------------

    def _clean_expired(self) -> None:
        with self._lock:
            self._clean_expired_locked()

    def _clean_expired_locked(self) -> None:
        """Drop expired messages (their channel leaves every group) and expired group memberships."""
        now = self.clock()
        for name, ch in list(self.channels.items()):
            while ch.messages and ch.messages[0][0] < now:
                ch.messages.popleft()
                self._remove_from_groups(name)
            if not ch.messages and not ch.waiters:
                del self.channels[name]
        timeout = int(now) - self.group_expiry
        for members in self.groups.values():
            for name, joined in list(members.items()):
                if joined and joined < timeout:
                    members.pop(name, None)

    # -- flush and groups ---------------------------------------------------------------------

    async def flush(self) -> None:
        """Every message and group gone; receivers already waiting stay parked for what comes next."""
        with self._lock:
            for name, ch in list(self.channels.items()):
                ch.messages.clear()
                if not ch.waiters:
                    del self.channels[name]
            self.groups = {}

    async def group_add(self, group: str, channel: str) -> None:
        self.require_valid_group_name(group)
        self.require_valid_channel_name(channel)
        with self._lock:
            self.groups.setdefault(group, {})[channel] = self.clock()

    async def group_discard(self, group: str, channel: str) -> None:
        self.require_valid_channel_name(channel)
        self.require_valid_group_name(group)
        with self._lock:
            members = self.groups.get(group)
            if members:
                members.pop(channel, None)
                if not members:
                    self.groups.pop(group, None)

    async def group_send(self, group: str, message: dict) -> None:
        """``message`` to every member of ``group``; a full member misses it (as InMemoryChannelLayer)."""
        assert isinstance(message, dict), "Message is not a dict"
        self.require_valid_group_name(group)
        with self._lock:
            self._clean_expired_locked()
            members = list(self.groups.get(group, ()))
        for channel in members:
            try:
                self._put(channel, _copy(message))
            except ChannelFull:
                pass
