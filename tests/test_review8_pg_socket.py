"""Review 8 of the PostgreSQL backend: the shutdown of a lock connection's socket from
another thread (the watchdog's cut, a release's interrupt) never reaches another
socket of the process, even when libpq has closed its own descriptor (the session
ended under a request) and the process has since reused that number.

Hypothesis draws the sequence of events on one real connection, and whether a thread
shuts the connection down over and over meanwhile; every socket opened along the
way must still carry data at the end.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from psycopg import pq

from distlocks.backends.postgres.pool import Connection
from tests.pg_backend import pg

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

EVENTS = ("interrupt", "cut", "drop", "open", "request", "close")


def terminate(pid: int) -> None:
    with psycopg.connect(**pg()._connect_kwargs()) as killer:
        killer.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))


def intact(pair: tuple[socket.socket, socket.socket]) -> bool:
    left, right = pair
    left.settimeout(10)
    right.settimeout(10)
    try:
        left.sendall(b"ping")
        right.sendall(b"pong")
        return right.recv(4) == b"ping" and left.recv(4) == b"pong"
    except OSError:
        return False


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(events=st.lists(st.sampled_from(EVENTS), max_size=10), hammer=st.booleans())
def test_a_shutdown_never_reaches_a_socket_that_reused_the_number(
    events: list[str], hammer: bool
) -> None:
    conn = Connection.connect(**pg()._connect_kwargs())
    conn.reply_timeout = 10.0
    libpq_fd = conn.pgconn.socket
    pairs: list[tuple[socket.socket, socket.socket]] = []
    stop = threading.Event()

    def shut_down_again_and_again() -> None:
        while not stop.is_set():
            conn.interrupt()

    hammering = threading.Thread(target=shut_down_again_and_again, daemon=True)
    if hammer:
        hammering.start()
    reused: list[int] = []
    try:
        for step in [*events, "drop", "open", "interrupt", "cut"]:
            if step == "interrupt":
                conn.interrupt()
            elif step == "cut":
                conn.cut()
            elif step == "drop" and not conn.closed and conn.pgconn.status == pq.ConnStatus.OK:
                # The server ends the session; the next request fails and libpq
                # closes its descriptor, whose number the next socket may take.
                terminate(conn.info.backend_pid)
                with pytest.raises(psycopg.OperationalError):
                    conn.execute("SELECT 1")
            elif step == "request" and not conn.closed:
                # Shut down or ended before: it fails, never hangs.
                with contextlib.suppress(psycopg.OperationalError):
                    conn.execute("SELECT 1")
            elif step == "open":
                pair = socket.socketpair()
                pairs.append(pair)
                reused += [s.fileno() for s in pair if s.fileno() == libpq_fd]
            elif step == "close":
                conn.close()
        event(f"libpq's descriptor number reused: {bool(reused)}")
        stop.set()
        if hammer:
            hammering.join(30)
            assert not hammering.is_alive()
        # After every shutdown has happened (the hammer's last included).
        conn.interrupt()
        conn.cut()
        broken = [i for i, pair in enumerate(pairs) if not intact(pair)]
        assert broken == [], f"sockets shut down by the connection's interrupt: {broken}"
    finally:
        stop.set()
        conn.close()
        for left, right in pairs:
            left.close()
            right.close()


class _PausingOs:
    """The pool module's ``os``, whose ``dup`` called from the thread named
    ``shutter`` waits until the test lets it go on: the window in which a shutdown
    that names the socket by its number (read, then duplicated) could be overtaken
    by libpq closing that number and another socket taking it."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.reached = threading.Event()
        self.go_on = threading.Event()

    def dup(self, fd: int) -> int:
        if threading.current_thread().name == "shutter":
            self.reached.set()
            self.go_on.wait(30)
        return int(self._real.dup(fd))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_a_shutdown_overtaken_by_the_reuse_of_libpq_s_number_spares_the_new_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shutdown runs on one thread while, on another, the session ends, libpq closes
    its descriptor and a new socket takes the same number. Whatever the order, the new
    socket is untouched (the shutdown names the connection's own duplicate, made when
    it connected, never libpq's number)."""
    from distlocks.backends.postgres import pool

    conn = Connection.connect(**pg()._connect_kwargs())
    conn.reply_timeout = 10.0
    libpq_fd = conn.pgconn.socket
    pausing = _PausingOs(pool.os)
    monkeypatch.setattr(pool, "os", pausing)
    shutter = threading.Thread(target=conn.interrupt, name="shutter", daemon=True)
    pair: tuple[socket.socket, socket.socket] | None = None
    try:
        shutter.start()
        pausing.reached.wait(2)  # reached only by a shutdown that duplicates by number
        terminate(conn.info.backend_pid)
        with contextlib.suppress(psycopg.OperationalError):
            conn.execute("SELECT 1")  # fails: libpq closes its descriptor
        assert conn.pgconn.status == pq.ConnStatus.BAD
        pair = socket.socketpair()
        assert libpq_fd in (pair[0].fileno(), pair[1].fileno()), "number not reused"
        pausing.go_on.set()
        shutter.join(30)
        assert not shutter.is_alive()
        assert intact(pair), "the shutdown of a closed connection cut another socket"
    finally:
        pausing.go_on.set()
        conn.close()
        if pair is not None:
            pair[0].close()
            pair[1].close()
