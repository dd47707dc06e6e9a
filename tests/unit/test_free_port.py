"""`gyre.net.free_port` never hands out a port twice in a row of picks: the launcher picks a dozen before any child
binds one, and the kernel's pick for port 0 repeats (a trainer once got its metrics port as its gRPC port)."""

from __future__ import annotations

import socket

import pytest
from gyre import net


class Picks:
    """socket.socket whose bind to port 0 lands on the next of `ports` (what the kernel would pick)."""

    def __init__(self, ports):
        self.ports = iter(ports)

    def __call__(self, *args):
        picks = self

        class Sock:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, address):
                self.port = next(picks.ports)

            def getsockname(self):
                return ("127.0.0.1", self.port)

        return Sock()


def test_a_port_the_kernel_picks_again_is_skipped(monkeypatch):
    monkeypatch.setattr(net, "_HANDED_OUT", type(net._HANDED_OUT)(maxlen=8))
    monkeypatch.setattr(net.socket, "socket", Picks([41000, 41000, 41001, 41000, 41001, 41002]))
    assert [net.free_port(), net.free_port(), net.free_port()] == [41000, 41001, 41002]


def test_only_ports_taken_lately_are_skipped_and_a_stuck_kernel_is_an_error(monkeypatch):
    monkeypatch.setattr(net, "_HANDED_OUT", type(net._HANDED_OUT)(maxlen=2))
    monkeypatch.setattr(net.socket, "socket", Picks([1, 2, 3, 1]))
    assert [net.free_port() for _ in range(4)] == [1, 2, 3, 1]  # 1 was forgotten once 2 and 3 came after it
    monkeypatch.setattr(net.socket, "socket", Picks([3] * 64))
    with pytest.raises(OSError, match="no free port on 127.0.0.1 that was not handed out already"):
        net.free_port()


def test_the_ports_are_really_free():
    ports = [net.free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # nobody holds it


def test_a_failed_bind_names_the_port_when_it_is_busy_and_the_host_when_it_is_not_this_machines():
    """The trainer's and the orchestrator's gRPC and /metrics servers: gRPC says only "Failed to bind" for both a busy
    port and a foreign address, and the message blamed the port for both (a pod IP in server.host: "set --server.port
    to a free port", which no port fixes)."""

    from gyre.grpc_server import ThreadedGrpcServer
    from gyre.net import PortInUse, bind_or_explain

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = ThreadedGrpcServer("test")
        with pytest.raises(PortInUse, match=rf"cannot listen on port {port} .*set --server.port to a free port"):
            bind_or_explain(lambda: server.start("127.0.0.1", port), "trainer", "server.port", port, "127.0.0.1")
    server = ThreadedGrpcServer("test")
    with pytest.raises(PortInUse, match=r"cannot listen on '192.0.2.1' .*set --server.host to one of its addresses"):
        bind_or_explain(lambda: server.start("192.0.2.1", 0), "trainer", "server.port", 0, "192.0.2.1")
