"""Several HTTP front ends on one host and one port (``serve --server-front-ends N``).

One Python process serves every request of the embedded mode on one interpreter lock: a
burst of requests is read, validated, rendered and tokenized one after another, between
the engine's own Python work. With ``server.front_ends`` N > 1 ``serve`` runs no HTTP itself:
it starts N ``serve`` children that bind the same port with SO_REUSEPORT (the kernel
spreads new connections over them) and the engine as ``runengine``, and supervises them.
Their Channels layer, the one seam between them, is a hub in this process on a Unix
socket (ignis_site/channel_hub.py), or Redis with ``server.redis_url`` (then the engine is
started here only with ``--with-engine``: it may run anywhere, as in a fleet).
A child that exits on its own ends the rest (the exit status says which); SIGTERM or
Ctrl-C is passed on to every child, which drain as they do alone.

Each child takes its configuration from the parent's environment and flags (as
environment variables), with ``server.front_ends`` 1 and ``server.reuse_port`` on; only
the first keeps ``server.metrics_bind`` (one listener per address) and the
announcement, and the parent runs the embedded Celery worker when it is on.
docs/FLEET.md ("Front ends on one host") says what else differs.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings

from ignis_site import config

log = logging.getLogger("ignis.server")

CHILD_ENV = "IGNIS_FRONT_END"  # "i/N" in a front end started by a parent serve (not a config key)
BACKLOG = 1024
STOP_GRACE = 30.0  # seconds children get after SIGTERM before they are killed


def front_end_index() -> int | None:
    """This process's index among its parent's front ends, or None when it was not started as one."""
    raw = os.environ.get(CHILD_ENV, "")
    head = raw.partition("/")[0]
    return int(head) if head.isdigit() else None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening IPv4 socket on ``host``:``port`` with SO_REUSEPORT (and SO_REUSEADDR), non-blocking,
    for Daphne to adopt (``fd:fileno=N``). Raises ValueError for an address this cannot bind."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("server.reuse_port needs SO_REUSEPORT, which this platform lacks")
    try:
        packed = socket.inet_aton(host)
    except OSError:
        raise ValueError(f"server.reuse_port takes an IPv4 host, not {host!r}") from None
    if port == 0:
        raise ValueError("server.reuse_port needs a fixed server.port (0 would give each process its own)")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((socket.inet_ntoa(packed), port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def child_environment(flags: dict, index: int, count: int) -> dict[str, str]:
    """The environment of front end ``index`` of ``count``: the parent's, its flags as variables, and
    what differs per child."""
    env = dict(os.environ)
    for key, value in flags.items():
        if value is not None and key in config.FIELDS:
            env[config.FIELDS[key].env_name] = _env_text(value)
    env[config.FIELDS["server.front_ends"].env_name] = "1"
    env[config.FIELDS["server.reuse_port"].env_name] = "true"
    env[config.FIELDS["server.celery_worker"].env_name] = "false"  # the parent's, if any
    if index:
        env[config.FIELDS["server.metrics_bind"].env_name] = ""
    env[CHILD_ENV] = f"{index}/{count}"
    return env


def _env_text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def check(values: dict) -> None:
    """Refuse a configuration N front ends cannot serve (ValueError, said as it is)."""
    reuse_port_socket(values["server.host"], values["server.port"]).close()  # the address is usable now


def hub_path(var_dir: Path) -> Path:
    """Where the hub's socket goes: the data directory, or a private temporary one when that path is
    past a Unix socket's length limit."""
    path = Path(var_dir) / "channels.sock"
    if len(str(path)) < 100:
        return path
    import tempfile

    return Path(tempfile.mkdtemp(prefix="ignis-hub-")) / "channels.sock"


class Supervisor:
    """The children of ``serve --server-front-ends N``: start, watch, stop."""

    def __init__(self, commands: list[tuple[str, list[str], dict[str, str]]], cwd: Path, poll: float = 0.2):
        self.commands = commands  # (name, argv, env)
        self.cwd = cwd
        self.poll = poll
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.stopping = False

    def start(self) -> None:
        for name, argv, env in self.commands:
            self.children.append((name, subprocess.Popen(argv, cwd=self.cwd, env=env)))
            log.info("ignis.server.front_end_started", extra={"child": name, "pid": self.children[-1][1].pid})

    def stop(self, *_signal) -> None:
        if self.stopping:  # asked twice: now
            for _name, proc in self.children:
                if proc.poll() is None:
                    proc.kill()
            return
        self.stopping = True
        for _name, proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        """Until every child has exited: 0 after a stop asked for, else 1 (a child ended on its own,
        and the rest were stopped)."""
        failed = None
        while True:
            for name, proc in self.children:
                if proc.poll() is not None and not self.stopping:
                    failed = name
                    log.error("ignis.server.front_end_exited", extra={"child": name, "code": proc.returncode})
                    self.stop()
            if all(proc.poll() is not None for _name, proc in self.children):
                return 1 if failed else 0
            if self.stopping:
                self._reap(time.monotonic() + STOP_GRACE)
            time.sleep(self.poll)

    def _reap(self, deadline: float) -> None:
        for _name, proc in self.children:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(values: dict, flags: dict, *, with_engine: bool, var_dir: Path, celery=None) -> int:
    """Start ``values["server.front_ends"]`` front ends and the engine's process (always over the hub;
    with Redis only ``with_engine``), supervise them until SIGTERM or SIGINT or until one ends on its
    own; the exit status. ``celery``: (start, stop) of the embedded Celery worker, run here when
    server.celery_worker is on."""
    from ignis_site.channel_hub import ChannelHub

    count = values["server.front_ends"]
    manage = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py")]
    hub = None
    extra = {}
    if not values["server.redis_url"]:
        from engine.messages import STATUS_GROUP

        hub = ChannelHub(hub_path(var_dir), retain=(STATUS_GROUP,))
        hub.start()
        extra[config.FIELDS["server.channel_hub"].env_name] = hub.path
        with_engine = True  # nothing else could reach this hub
        log.info("ignis.server.channel_hub", extra={"path": hub.path, "front_ends": count})
    commands = []
    if with_engine:
        env = {**child_environment(flags, 0, count), **extra}
        env.pop(CHILD_ENV)
        commands.append(("engine", [*manage, "runengine"], env))
    for i in range(count):
        env = {**child_environment(flags, i, count), **extra}
        commands.append((f"front-end-{i}", [*manage, "serve", "--no-download"], env))
    supervisor = Supervisor(commands, cwd=Path(manage[1]).parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.stop)
    worker = celery[0]() if celery is not None and values["server.celery_worker"] else None
    supervisor.start()
    try:
        return supervisor.wait()
    finally:
        if hub is not None:
            hub.stop()
        if worker is not None:
            celery[1](worker)
