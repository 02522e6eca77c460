"""The PostgreSQL lock cycle's client layers (issue 29): what the hot path no longer
does per call, and that each saving kept its guarantee (the reply watchdog, dead
pooled connections, results given to the caller whose statement made them)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from distlocks import lock
from distlocks.backends.postgres.pool import Connection, Pool, PoolExhausted, Watchdog
from tests.pg_backend import pg
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


class _Watched:
    """What the watchdog watches: anything it can cut."""

    def __init__(self) -> None:
        self.cuts = 0

    def cut(self) -> None:
        self.cuts += 1


class _CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_a_ticking_watchdog_is_not_woken_by_each_request() -> None:
    watchdog = Watchdog()
    wake = watchdog._wake = _CountingEvent()
    pinned = _Watched()
    # Something stays watched, so the thread never goes to sleep during the test.
    watchdog.watch(pinned, float("inf"))  # type: ignore[arg-type]
    wait_for(lambda: watchdog._thread is not None and watchdog._thread.is_alive(), 15)
    wait_for(lambda: not watchdog._asleep, 15, "the watchdog thread ticking")
    before = wake.sets
    other = _Watched()
    for _ in range(200):
        watchdog.watch(other, float("inf"))  # type: ignore[arg-type]
        watchdog.unwatch(other)  # type: ignore[arg-type]
    assert wake.sets == before
    watchdog.unwatch(pinned)  # type: ignore[arg-type]


def test_a_ticking_watchdog_still_cuts_a_request_past_its_deadline() -> None:
    watchdog = Watchdog()
    pinned, late = _Watched(), _Watched()
    watchdog.watch(pinned, float("inf"))  # type: ignore[arg-type]
    wait_for(lambda: not watchdog._asleep, 15, "the watchdog thread ticking")
    watchdog.watch(late, 0.0)  # type: ignore[arg-type]
    wait_for(lambda: late.cuts == 1, 15, "the late request cut")
    assert pinned.cuts == 0
    watchdog.unwatch(pinned)  # type: ignore[arg-type]


def test_the_lock_cycle_builds_no_cursor_per_statement(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with lock(name, backend="pg", timeout=0):  # a pooled connection, its cursor made
        pass
    made: list[Any] = []
    real = Connection.cursor

    def counted(self: Connection, *args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Connection, "cursor", counted)
    for _ in range(3):
        with lock(name, backend="pg", timeout=0) as lease:
            lease.extend()
    assert made == []


def test_fetchone_gives_each_thread_its_own_statement_s_row() -> None:
    conn = pg().pool.get()
    try:
        errors: list[BaseException] = []

        def ask(value: int) -> None:
            try:
                for _ in range(100):
                    row = conn.fetchone("SELECT %s::int, pg_sleep(0)", (value,))
                    assert row is not None and row[0] == value
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
    finally:
        pg().pool.put(conn)


def test_fetchone_after_a_failed_statement_still_answers() -> None:
    conn = pg().pool.get()
    try:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.fetchone("SELECT 1 / %s", (0,))
        assert conn.fetchone("SELECT %s::int", (7,)) == (7,)
    finally:
        pg().pool.put(conn)


@pytest.mark.parametrize("closed", [False, True], ids=["given-back", "discarded"])
def test_a_caller_waiting_for_a_full_pool_gets_the_connection_put_back(closed: bool) -> None:
    pool = Pool(pg()._connect_kwargs(), max_size=1, timeout=60.0, reply_timeout=5.0)
    first = pool.get()
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.get()))
    waiter.start()
    try:
        wait_for(lambda: pool._waiting == 1, 15, "the second caller waiting")
        if closed:
            first.close()
        pool.put(first)
        waiter.join(30)
        assert not waiter.is_alive(), "the waiter was not woken by the connection put back"
        assert len(got) == 1 and not got[0].closed
        assert (got[0] is first) is not closed
        with pytest.raises(PoolExhausted):
            pool.get(timeout=0.01)
        pool.put(got[0])
    finally:
        waiter.join(60)
        pool.close()


# -- the third pass (issue 29, item 2): the hot path's calls and system calls


def test_the_pool_probes_an_idle_connection_outside_its_lock() -> None:
    """The check that an idle connection still lives is a system call: other threads
    must not wait for the pool's lock meanwhile."""
    pool = Pool(pg()._connect_kwargs(), max_size=2, timeout=5.0, reply_timeout=5.0)
    try:
        conn = pool.get()
        pool.put(conn)
        real = conn._idle_probe
        held_during_probe: list[bool] = []

        class Probe:
            def poll(self, timeout: int) -> list[Any]:
                held_during_probe.append(pool._lock.locked())
                return real.poll(timeout)

        conn._idle_probe = Probe()  # type: ignore[assignment]
        again = pool.get()
        assert again is conn
        assert held_during_probe == [False]
        pool.put(again)
    finally:
        pool.close()


def test_a_connection_found_dead_by_the_probe_frees_its_slot() -> None:
    """The probe outside the lock still gives the slot of a dead connection back: a
    pool of one then connects anew instead of waiting for its whole timeout."""
    pool = Pool(pg()._connect_kwargs(), max_size=1, timeout=60.0, reply_timeout=5.0)
    try:
        conn = pool.get()
        pid = conn.info.backend_pid
        pool.put(conn)
        with psycopg.connect(**pg()._connect_kwargs()) as killer:
            killer.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        wait_for(lambda: bool(conn._idle_probe.poll(0)), 15, "the server's close seen")
        fresh = pool.get()
        assert fresh is not conn and conn.closed
        assert fresh.info.backend_pid != pid
        assert pool._count == 1
        pool.put(fresh)
    finally:
        pool.close()


def test_the_usual_acquire_encodes_nothing_through_the_generic_encoder(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Name, holder and ttl are encoded once and cached; the owner id (a new one each
    acquire) is plain text: the generic encoder is left for the rare values."""
    from distlocks.backends.postgres import wire

    with lock(name, backend="pg", ttl=30, timeout=0):  # caches filled
        pass
    calls: list[Any] = []
    real = wire.encode

    def counted(value: Any, encoding: str) -> bytes | None:
        calls.append(value)
        return real(value, encoding)

    monkeypatch.setattr(wire, "encode", counted)
    for _ in range(3):
        with lock(name, backend="pg", ttl=30, timeout=0):
            pass
    assert calls == []


def test_an_owner_with_a_nul_is_still_refused_as_psycopg_refuses_it(name: str) -> None:
    from distlocks.exceptions import LockError
    from distlocks.locks import current_holder

    with pytest.raises(LockError, match="NUL"):
        pg().acquire(name, "owner\x00id", 30.0, current_holder())
    assert pg().held_connection_count() == 0


@pytest.mark.parametrize("state", ["asleep", "ticking"])
def test_a_request_unanswered_past_its_deadline_is_cut_whatever_the_watchdog_does(
    state: str,
) -> None:
    """A request's deadline is seen by the reply watchdog's thread whether it was
    asleep (woken by the request) or ticking (found at its next tick)."""
    from distlocks.backends.postgres.pool import NoAnswer, watchdog
    from distlocks.backends.postgres.wire import Statement

    sleep = Statement("distlocks_test_sleep", "SELECT pg_sleep(%(ttl)s)::text", lambda v: v)
    pinned = _Watched()
    conn = pg().pool.get()
    server_pid = conn.info.backend_pid
    try:
        conn.reply_timeout = 0.5
        if state == "asleep":
            wait_for(lambda: watchdog._asleep and not watchdog._watched, 15, "watchdog asleep")
        else:
            watchdog.watch(pinned, float("inf"))  # type: ignore[arg-type]
            wait_for(lambda: not watchdog._asleep, 15, "the watchdog thread ticking")
        with pytest.raises(NoAnswer):
            conn.value_encoded(sleep, [b"60"])
        assert pinned.cuts == 0
    finally:
        watchdog.unwatch(pinned)  # type: ignore[arg-type]
        pg()._discard(conn)
        # The cut closed the client's end only: the server's session sleeps on, and
        # the test database could not be dropped at the end of the session.
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [server_pid])
