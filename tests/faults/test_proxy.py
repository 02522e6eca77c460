"""The fault proxy does what the scenarios rely on: relays, delays in order,
swallows, resets and refuses. Checked against a loopback echo server."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faults.proxy import FaultProxy
from tests.waiting import wait_for


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError):  # the reset tests do that
            while data := self.request.recv(4096):
                self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = FaultProxy(server.server_address[1]).start()
    yield proxy
    proxy.close()
    server.shutdown()
    server.server_close()


def connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_relays_both_ways(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert echo(sock, b"ping") == b"ping"
    wait_for(lambda: proxy.stats["up_out"] == proxy.stats["down_out"] == 4, what="counted")


def test_latency_delays_in_order(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        proxy.set_latency(0.2)
        started = time.monotonic()
        sock.sendall(b"one")
        wait_for(lambda: proxy.stats["up_in"] == 3, what="the first chunk read")
        proxy.set_latency(0)  # a later chunk never overtakes an earlier one
        sock.sendall(b"two")
        got = b""
        while len(got) < 6:
            got += sock.recv(16)
        assert got == b"onetwo"
        assert time.monotonic() - started >= 0.2


def test_blackhole_swallows_and_keeps_the_connection(proxy: FaultProxy) -> None:
    with connect(proxy, timeout=0.3) as sock:
        proxy.blackhole()
        sock.sendall(b"lost")
        with pytest.raises(socket.timeout):
            sock.recv(16)
        assert proxy.stats["swallowed"] == 4
        proxy.blackhole(False)
        assert echo(sock, b"back") == b"back"


def test_reset_aborts_open_connections(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert echo(sock, b"x") == b"x"
        assert proxy.reset() == 1
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"y")
            sock.recv(16)
            sock.sendall(b"z")  # the reset may surface on the next call only


def test_drop_refuses_new_connections(proxy: FaultProxy) -> None:
    proxy.drop()
    with pytest.raises(ConnectionResetError):  # at connect or at the first read
        with connect(proxy) as sock:
            sock.recv(16)
    assert proxy.stats["dropped"] == 1
    proxy.drop(False)
    with connect(proxy) as sock:
        assert echo(sock, b"ok") == b"ok"


def test_only_loopback_upstreams() -> None:
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy(80, "192.0.2.1")
