"""serve --server-front-ends N's parts (apps/models/management/commands/_front_ends.py): the shared
port, each child's environment, the supervisor."""

from __future__ import annotations

import socket
import sys

import pytest

from apps.models.management.commands import _front_ends as fe
from ignis_site import config
from tests.e2e.server import free_port


def test_reuse_port_sockets_share_a_port_and_refuse_what_they_cannot_bind():
    port = free_port()
    a = fe.reuse_port_socket("127.0.0.1", port)
    b = fe.reuse_port_socket("127.0.0.1", port)  # a second process's bind: no EADDRINUSE
    try:
        assert a.getsockname() == b.getsockname() == ("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted by one of them
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="IPv4"):
        fe.reuse_port_socket("::1", port)
    with pytest.raises(ValueError, match="fixed server.port"):
        fe.reuse_port_socket("127.0.0.1", 0)
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    try:  # a port held without SO_REUSEPORT stays refused
        with pytest.raises(OSError):
            fe.reuse_port_socket("127.0.0.1", plain.getsockname()[1])
    finally:
        plain.close()


def test_each_child_gets_the_parents_flags_and_its_own_part(monkeypatch):
    monkeypatch.setenv("IGNIS_MODEL_BACKEND", "cpu")
    flags = {"model.prefill_chunk": 256, "model.async_rounds": False, "server.port": 8123, "not.a.key": 1}
    first = fe.child_environment(flags, 0, 3)
    second = fe.child_environment(flags, 1, 3)
    name = lambda key: config.FIELDS[key].env_name  # noqa: E731
    for env in (first, second):
        assert env[name("model.prefill_chunk")] == "256"
        assert env[name("model.async_rounds")] == "false"  # as the settings parse it back
        assert config.FIELDS["model.async_rounds"].parse(env[name("model.async_rounds")]) is False
        assert env[name("server.port")] == "8123"
        assert env[name("server.front_ends")] == "1"  # a child never starts children
        assert env[name("server.reuse_port")] == "true"
        assert env[name("server.celery_worker")] == "false"
        assert env["IGNIS_MODEL_BACKEND"] == "cpu"  # the parent's environment too
    assert name("server.metrics_bind") not in first  # the first keeps the listener
    assert second[name("server.metrics_bind")] == ""
    assert (first[fe.CHILD_ENV], second[fe.CHILD_ENV]) == ("0/3", "1/3")


def test_front_end_index_reads_the_childs_mark(monkeypatch):
    monkeypatch.delenv(fe.CHILD_ENV, raising=False)
    assert fe.front_end_index() is None
    monkeypatch.setenv(fe.CHILD_ENV, "2/4")
    assert fe.front_end_index() == 2


def sleeper(seconds: float, code: int = 0) -> list[str]:
    return [sys.executable, "-c", f"import sys, time; time.sleep({seconds}); sys.exit({code})"]


def test_a_child_that_ends_on_its_own_ends_the_rest(tmp_path):
    sup = fe.Supervisor([("quits", sleeper(0.2, 3), {}), ("stays", sleeper(60), {})], cwd=tmp_path, poll=0.05)
    sup.start()
    assert sup.wait() == 1
    assert sup.children[0][1].returncode == 3
    assert sup.children[1][1].returncode not in (None, 0)  # stopped by the supervisor, not finished


def test_a_stop_passes_sigterm_on_and_exits_cleanly(tmp_path):
    sup = fe.Supervisor([("a", sleeper(60), {}), ("b", sleeper(60), {})], cwd=tmp_path, poll=0.05)
    sup.start()
    sup.stop()
    assert sup.wait() == 0
    assert all(proc.returncode == -15 for _name, proc in sup.children)
