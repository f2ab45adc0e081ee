"""A Channels layer between processes of one host: a hub on a Unix socket, without Redis.

``serve --server-front-ends N`` (apps/models/management/commands/_front_ends.py) runs the engine and N HTTP
front ends as processes of their own, so request parsing, rendering and streaming never
share an interpreter lock with the engine's launches. Redis can carry their messages
(scaled mode), at a round trip through its server and channels_redis' Python for every
token message; on one host this hub does the same job with less: the parent process
holds a ``ChannelHub`` on a Unix socket under the data directory, and every child's
``HubChannelLayer`` keeps one connection to it.

The hub routes frames without reading the messages in them: a frame names a channel (or
a group) and carries the message pickled by the sender (the socket is the parent's own,
mode 0600 in the data directory: only these processes reach it). A process says which
channels it receives on (``listen``) the first time it receives on one; a message for a
channel nobody listens on yet waits at the hub (``capacity`` per channel, ``expiry``
seconds), and goes out when a listener comes. Groups live at the hub. A process that goes
away takes its listens and memberships with it.

In each process ``HubChannelLayer`` is ``CrossLoopChannelLayer`` for what arrives (its
receivers on any thread and loop, its expiry and capacity), plus the connection: a send
to a channel this process listens on stays here, any other goes to the hub (a blocking
write under a lock: a few microseconds, on whatever thread sends), and a reader thread
puts what the hub delivers on the local channels. A lost connection is made again, its
listens and memberships said again; what was in flight is lost, as a Redis restart
loses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections import deque
from pathlib import Path

from channels.exceptions import ChannelFull

from ignis_site.channel_layer import CrossLoopChannelLayer

log = logging.getLogger("ignis.channel_hub")

# A frame: u32 length of the rest, u8 op, u16 length of a name, the name, then the rest (a second
# name the same way for the group ops, or the pickled message).
HEAD = struct.Struct(">IB")
NAME = struct.Struct(">H")
LISTEN, SEND, GROUP_ADD, GROUP_DISCARD, GROUP_SEND, FLUSH, DELIVER = range(1, 8)
MAX_FRAME = 256 << 20  # a frame longer than this is a broken peer, not a message


def frame(op: int, name: str, rest: bytes = b"") -> bytes:
    raw = name.encode()
    return HEAD.pack(1 + NAME.size + len(raw) + len(rest), op) + NAME.pack(len(raw)) + raw + rest


def member_frame(op: int, group: str, channel: str) -> bytes:
    """GROUP_ADD / GROUP_DISCARD: the group's name, then the channel's."""
    raw = channel.encode()
    return frame(op, group, NAME.pack(len(raw)) + raw)


def pickled(message: dict) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def split_name(body: bytes) -> tuple[str, bytes]:
    """(the name at the front of ``body``, what follows it)."""
    (n,) = NAME.unpack_from(body)
    end = NAME.size + n
    return body[NAME.size : end].decode(), body[end:]


# -- the hub ---------------------------------------------------------------------------------


class _Peer:
    __slots__ = ("writer", "listens", "joined", "name")

    def __init__(self, writer: asyncio.StreamWriter, name: str) -> None:
        self.writer = writer
        self.listens: set[str] = set()
        self.joined: set[tuple[str, str]] = set()  # (group, channel) it added
        self.name = name


class ChannelHub:
    """The routing process's side: a Unix-socket server on its own thread and event loop."""

    def __init__(
        self,
        path: str | Path,
        *,
        capacity: int = 2000,
        expiry: float = 120.0,
        group_expiry: float = 86400,
        retain: tuple[str, ...] = (),
    ):
        self.path = str(path)
        # Groups whose last message a new member gets at once (the engine's status: a front end that
        # starts after a heartbeat knows the engine now, not at the next beat).
        self.retain = frozenset(retain)
        self.retained: dict[str, bytes] = {}
        self.capacity = capacity
        self.expiry = expiry
        self.group_expiry = group_expiry
        self.listeners: dict[str, _Peer] = {}
        self.waiting: dict[str, deque[tuple[float, bytes]]] = {}  # channel -> (expires, DELIVER frame)
        self.groups: dict[str, dict[str, float]] = {}  # group -> {channel: joined}
        self.dropped = 0  # messages past a waiting channel's capacity
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._peers = 0

    def start(self) -> None:
        """Listen (the socket file made 0600 before anyone can connect), on a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="ignis-channel-hub", daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._server is None:
            raise RuntimeError(f"the channel hub could not listen on {self.path}")

    def stop(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        Path(self.path).unlink(missing_ok=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            Path(self.path).unlink(missing_ok=True)
            old = os.umask(0o177)
            try:
                self._server = self.loop.run_until_complete(asyncio.start_unix_server(self._serve, path=self.path))
            finally:
                os.umask(old)
            self.loop.create_task(self._expire_loop())
        except OSError:
            log.exception("ignis.channel_hub.listen_failed", extra={"path": self.path})
        finally:
            self._started.set()
        if self._server is not None:
            self.loop.run_forever()
            self._server.close()
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._peers += 1
        peer = _Peer(writer, f"peer-{self._peers}")
        try:
            while True:
                length, op = HEAD.unpack(await reader.readexactly(HEAD.size))
                if length < 1 or length > MAX_FRAME:
                    log.error("ignis.channel_hub.bad_frame", extra={"peer": peer.name, "length": length})
                    return
                self._handle(peer, op, await reader.readexactly(length - 1))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._forget(peer)
            writer.close()

    def _handle(self, peer: _Peer, op: int, body: bytes) -> None:
        name, rest = split_name(body)
        if op == SEND:  # the same body, delivered: only the op differs
            self._route(name, HEAD.pack(len(body) + 1, DELIVER) + body)
        elif op == LISTEN:
            self.listeners[name] = peer
            peer.listens.add(name)
            for _expires, data in self.waiting.pop(name, ()):
                peer.writer.write(data)
        elif op == GROUP_SEND:
            if name in self.retain:
                self.retained[name] = rest
            for channel in list(self.groups.get(name, ())):
                self._route(channel, frame(DELIVER, channel, rest))
        elif op == GROUP_ADD:
            channel, _ = split_name(rest)
            members = self.groups.setdefault(name, {})
            if channel not in members and name in self.retained:
                self._route(channel, frame(DELIVER, channel, self.retained[name]))
            members[channel] = time.monotonic()
            peer.joined.add((name, channel))
        elif op == GROUP_DISCARD:
            channel, _ = split_name(rest)
            members = self.groups.get(name)
            if members is not None:
                members.pop(channel, None)
                if not members:
                    del self.groups[name]
        elif op == FLUSH:
            self.waiting.clear()
            self.groups.clear()
            self.retained.clear()

    def _route(self, channel: str, data: bytes) -> None:
        peer = self.listeners.get(channel)
        if peer is not None:
            peer.writer.write(data)
            return
        queue = self.waiting.setdefault(channel, deque())
        if len(queue) >= self.capacity:  # nobody reads it: the oldest goes (the sender is not waited for)
            queue.popleft()
            self.dropped += 1
        queue.append((time.monotonic() + self.expiry, data))

    def _forget(self, peer: _Peer) -> None:
        gone = {c for c in peer.listens if self.listeners.get(c) is peer}
        for channel in gone:
            del self.listeners[channel]
        for members in self.groups.values():
            for channel in gone:
                members.pop(channel, None)
        for group, channel in peer.joined:
            self.groups.get(group, {}).pop(channel, None)
        self.groups = {g: m for g, m in self.groups.items() if m}

    async def _expire_loop(self, every: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for channel, queue in list(self.waiting.items()):
                while queue and queue[0][0] < now:
                    queue.popleft()
                if not queue:
                    del self.waiting[channel]
            for group, members in list(self.groups.items()):
                for channel, joined in list(members.items()):
                    if joined < now - self.group_expiry:
                        del members[channel]
                if not members:
                    del self.groups[group]


# -- each process's layer ------------------------------------------------------------------------


class HubChannelLayer(CrossLoopChannelLayer):
    """CrossLoopChannelLayer whose other processes are reached through a ``ChannelHub`` at ``path``."""

    def __init__(self, path: str = "", reconnect: float = 0.2, **kwargs):
        super().__init__(**kwargs)
        self.path = path
        self.reconnect = reconnect
        self._sock: socket.socket | None = None
        self._write_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._listening: set[str] = set()
        self._memberships: set[tuple[str, str]] = set()
        self._closed = False

    # -- the connection ------------------------------------------------------------------------

    def _connection(self) -> socket.socket:
        sock = self._sock
        if sock is not None:
            return sock
        with self._connect_lock:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(self.path)
                hello = [frame(LISTEN, c) for c in sorted(self._listening)]
                hello += [member_frame(GROUP_ADD, g, c) for g, c in self._memberships]
                if hello:
                    sock.sendall(b"".join(hello))
                self._sock = sock
                threading.Thread(target=self._read, args=(sock,), name="ignis-channel-hub-reader", daemon=True).start()
            return self._sock

    def _write(self, data: bytes) -> None:
        for attempt in (0, 1):
            sock = self._connection()
            try:
                with self._write_lock:
                    sock.sendall(data)
                return
            except OSError:
                self._lost(sock)
                if attempt:
                    raise

    def _lost(self, sock: socket.socket) -> None:
        with self._connect_lock:
            if self._sock is sock:
                self._sock = None
        _shut(sock)

    def _read(self, sock: socket.socket) -> None:
        """The reader thread: what the hub delivers onto this process's channels; reconnects when lost."""
        stream = sock.makefile("rb", buffering=1 << 16)
        try:
            while True:
                head = stream.read(HEAD.size)
                if len(head) < HEAD.size:
                    break
                length, op = HEAD.unpack(head)
                body = stream.read(length - 1)
                if len(body) < length - 1:
                    break
                if op != DELIVER:
                    continue
                channel, payload = split_name(body)
                try:
                    self._put(channel, pickle.loads(payload))
                except ChannelFull:
                    log.warning("ignis.channel_hub.channel_full", extra={"channel": channel})
                except Exception:
                    log.exception("ignis.channel_hub.bad_message", extra={"channel": channel})
        except OSError:
            pass
        self._lost(sock)
        if not self._closed:
            self._reconnect_later()

    def _reconnect_later(self) -> None:
        """Listens and memberships said again as soon as the hub answers (it may be restarting)."""
        while not self._closed:
            time.sleep(self.reconnect)
            try:
                self._connection()
                return
            except OSError:
                continue

    # -- the layer -----------------------------------------------------------------------------

    async def send(self, channel: str, message: dict) -> None:
        assert isinstance(message, dict), "message is not a dict"
        self.require_valid_channel_name(channel)
        if channel in self._listening:
            await super().send(channel, message)
            return
        self._write(frame(SEND, channel, pickled(message)))

    async def receive(self, channel: str) -> dict:
        self.require_valid_channel_name(channel)
        if channel not in self._listening:
            self._listening.add(channel)
            self._write(frame(LISTEN, channel))
        return await super().receive(channel)

    async def group_add(self, group: str, channel: str) -> None:
        self.require_valid_group_name(group)
        self.require_valid_channel_name(channel)
        self._memberships.add((group, channel))
        self._write(member_frame(GROUP_ADD, group, channel))

    async def group_discard(self, group: str, channel: str) -> None:
        self.require_valid_group_name(group)
        self.require_valid_channel_name(channel)
        self._memberships.discard((group, channel))
        self._write(member_frame(GROUP_DISCARD, group, channel))

    async def group_send(self, group: str, message: dict) -> None:
        assert isinstance(message, dict), "Message is not a dict"
        self.require_valid_group_name(group)
        self._write(frame(GROUP_SEND, group, pickled(message)))

    async def flush(self) -> None:
        await super().flush()
        self._memberships.clear()
        self._write(frame(FLUSH, ""))

    def close(self) -> None:
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Close for good: shut down first, as the reader thread's file object keeps the descriptor open."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
