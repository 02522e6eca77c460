"""Review 5: the PostgreSQL pool's idle probe, now outside the pool's lock.

A slot is the pool's count of connections it answers for (idle or checked out): the
count must never exceed ``max_size``, and every connection that leaves the pool's hands
without being checked out (found dead, interrupted) must give its slot back, or a
small pool waits its whole timeout and fails with every connection "in use".
Real servers throughout: idle connections are ended with ``pg_terminate_backend``.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from distlocks import get_backend
from distlocks.backends.postgres import PostgresBackend
from distlocks.backends.postgres.pool import Connection, Pool, PoolExhausted
from tests.waiting import run_threads, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


def _kwargs() -> dict[str, Any]:
    backend = get_backend("pg")
    assert isinstance(backend, PostgresBackend)
    return backend._connect_kwargs()


def _terminate(pids: list[int]) -> None:
    with psycopg.connect(**_kwargs()) as killer:
        killer.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM unnest(%s::int[]) AS pid", (pids,)
        )


def _seen_dead(conn: Connection) -> bool:
    """The server's close has reached this idle connection's socket."""
    return conn.closed or bool(conn._idle_probe.poll(0))


class _Interrupted(BaseException):
    """Stands for a KeyboardInterrupt or a Celery soft time limit raised in the thread
    while it checks a connection out (a signal handler runs between two bytecodes)."""


@pytest.mark.parametrize("dead", [False, True], ids=["alive", "dead"])
def test_an_interrupt_during_the_idle_probe_gives_the_slot_back(dead: bool) -> None:
    """The probe of an idle connection runs outside the pool's lock, after the
    connection left the idle list: an exception raised there (a signal's handler) must
    not take the connection's slot with it. Failed before: the pool of one was left
    with no idle connection and a count of 1, and the next checkout waited its whole
    timeout for a connection nobody would give back (PoolExhausted)."""
    pool = Pool(_kwargs(), max_size=1, timeout=0.0, reply_timeout=5.0)
    try:
        conn = pool.get()
        pid = conn.info.backend_pid
        pool.put(conn)
        if dead:
            _terminate([pid])
            wait_for(lambda: _seen_dead(conn), 30, "the server's close seen")

        class Probe:
            def poll(self, timeout: int) -> list[Any]:
                raise _Interrupted

        conn._idle_probe = Probe()  # type: ignore[assignment]
        with pytest.raises(_Interrupted):
            pool.get()
        assert pool._count == len(pool._idle) <= 1
        again = pool.get()  # a pool of one, checked out at once: no slot was lost
        assert again.execute("SELECT 1").fetchone() == (1,)
        pool.put(again)
    finally:
        pool.close()


def test_an_interrupt_while_closing_a_dead_connection_gives_the_slot_back() -> None:
    """Same, for an exception raised as a connection found dead is closed."""
    pool = Pool(_kwargs(), max_size=1, timeout=0.0, reply_timeout=5.0)
    try:
        conn = pool.get()
        pool.put(conn)
        _terminate([conn.info.backend_pid])
        wait_for(lambda: _seen_dead(conn), 30, "the server's close seen")
        real_close = conn.close
        calls: list[int] = []

        def close() -> None:
            calls.append(1)
            real_close()
            if len(calls) == 1:
                raise _Interrupted

        conn.close = close  # type: ignore[method-assign]
        with pytest.raises(_Interrupted):
            pool.get()
        assert pool._count == len(pool._idle) == 0
        again = pool.get()
        assert again.execute("SELECT 1").fetchone() == (1,)
        pool.put(again)
    finally:
        pool.close()


MAX = 3


class PoolMachine(RuleBasedStateMachine):
    """The pool against a model: the connections checked out. Idle connections are
    ended by the server at any point; a checkout never gives one that the probe could
    have seen dead, never more than MAX at once, and never fails while fewer than MAX
    are out."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(_kwargs(), max_size=MAX, timeout=0.0, reply_timeout=5.0)
        self.out: list[Connection] = []

    @rule()
    def check_out(self) -> None:
        if len(self.out) >= MAX:
            with pytest.raises(PoolExhausted):
                self.pool.get()
            return
        conn = self.pool.get()
        assert conn not in self.out
        # Alive: an idle connection the server ended is never handed out.
        assert conn.execute("SELECT 1").fetchone() == (1,)
        self.out.append(conn)

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        conn = self.out.pop(data.draw(st.integers(0, len(self.out) - 1)))
        self.pool.put(conn)

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        """As the backend discards a connection in an unknown state: closed, then put."""
        conn = self.out.pop(data.draw(st.integers(0, len(self.out) - 1)))
        conn.close()
        self.pool.put(conn)

    @precondition(lambda self: self.pool._idle)
    @rule(data=st.data())
    def end_idle(self, data: st.DataObject) -> None:
        """A DBA's pg_terminate_backend, a restart: idle connections end."""
        idle = list(self.pool._idle)
        ended = data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True))
        _terminate([conn.info.backend_pid for conn in ended])
        for conn in ended:
            wait_for(lambda conn=conn: _seen_dead(conn), 30, "the server's close seen")

    @invariant()
    def slots_match(self) -> None:
        assert self.pool._count == len(self.out) + len(self.pool._idle) <= MAX
        assert self.pool._waiting == 0

    def teardown(self) -> None:
        for conn in self.out:
            self.pool.put(conn)
        self.pool.close()
        assert self.pool._count == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_threads_racing_checkouts_while_idle_connections_die() -> None:
    """Eight threads check out, use and give back a pool of three while another ends
    idle connections: never more than three out at once, no slot lost, and the count
    ends equal to the idle connections."""
    pool = Pool(_kwargs(), max_size=MAX, timeout=120.0, reply_timeout=30.0)
    out_lock = threading.Lock()
    out = [0]
    most = [0]
    errors: list[BaseException] = []
    stop = threading.Event()
    rounds = 40

    def worker() -> None:
        try:
            for _ in range(rounds):
                conn = pool.get()
                with out_lock:
                    out[0] += 1
                    most[0] = max(most[0], out[0])
                try:
                    conn.execute("SELECT 1").fetchone()
                except psycopg.OperationalError:
                    # Ended between the probe and the statement: as the backend does.
                    conn.close()
                finally:
                    with out_lock:
                        out[0] -= 1
                    pool.put(conn)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def killer() -> None:
        with psycopg.connect(**_kwargs()) as admin:
            while not stop.is_set():
                pids = [c.info.backend_pid for c in list(pool._idle) if not c.closed]
                if pids:
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                        (pids,),
                    )
                stop.wait(0.01)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    kill = threading.Thread(target=killer)
    kill.start()
    try:
        run_threads(threads, 300)
    finally:
        stop.set()
        kill.join(60)
    try:
        assert errors == []
        assert most[0] <= MAX
        assert pool._count == len(pool._idle) <= MAX
        assert pool._waiting == 0
    finally:
        pool.close()
    assert pool._count == 0


def _own_backend() -> PostgresBackend:
    """A backend instance of the "pg" alias's settings, apart from the handler's."""
    shared = get_backend("pg")
    assert isinstance(shared, PostgresBackend)
    return PostgresBackend("pg", shared.config)


def test_a_connection_given_back_after_the_backend_closed_goes_to_no_other_pool(
    name: str,
) -> None:
    """backend.close() (a settings change resets the backends) while a statement is
    under way on a pooled connection: that connection, given back afterwards, must not
    join the backend's next pool uncounted (its bound then exceeded by one, and its
    count gone below zero later), nor stay open in the closed one. Failed before: the
    new pool had one idle connection and a count of 0."""
    backend = _own_backend()
    try:
        with backend._pooled("inspect", name) as conn:
            backend.close()  # from another thread, as the statement runs
            assert conn.execute("SELECT 1").fetchone() == (1,)
        new = backend.pool
        assert new._count == len(new._idle) == 0
        assert conn.closed  # the closed pool's connection is closed, not kept
        assert backend.inspect(name) is None  # the new pool works
        assert new._count == len(new._idle) == 1
    finally:
        backend.close()


def test_a_lease_taken_as_the_backend_closes_is_not_given_to_the_next_pool(name: str) -> None:
    """A try that was refused, its connection given back after backend.close()."""
    backend = _own_backend()
    other = _own_backend()
    from distlocks.locks import current_holder

    try:
        assert other.acquire(name, "a" * 32, 30.0, current_holder()).acquired
        real = backend._checkout

        def checkout(lock_name: str, wait: float | None = None) -> Connection:
            conn = real(lock_name, wait)
            backend.close()  # as another thread resets the backends
            return conn

        backend._checkout = checkout  # type: ignore[method-assign]
        assert not backend.acquire(name, "b" * 32, 30.0, current_holder()).acquired
        new = backend.pool
        assert new._count == len(new._idle) == 0
    finally:
        other.close()
        backend.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ttl=st.one_of(
        st.floats(0.01, 365 * 86400),
        st.integers(1, 365 * 86400),
        st.sampled_from([1, 1.0, 0.1 + 0.2, 30, 30.0, 365 * 86400, 0.01]),
    )
)
def test_the_registry_records_each_ttl_as_given_whatever_was_cached_before(ttl: float) -> None:
    """The acquire try's ttl text is cached by value (floats only): 1 and 1.0 and
    every float that was cached earlier in the session must still record the ttl given,
    as the server reads it back (double precision: exact for every float)."""
    import uuid

    from distlocks.locks import current_holder

    backend = get_backend("pg")
    name, owner = f"review5-ttl:{uuid.uuid4().hex}", uuid.uuid4().hex
    assert backend.acquire(name, owner, ttl, current_holder()).acquired
    try:
        with backend._pooled("inspect", name) as conn:  # type: ignore[attr-defined]
            row = conn.execute(
                "SELECT ttl FROM distlocks_lockregistry WHERE name = %s", (name,)
            ).fetchone()
        assert row is not None and row[0] == float(ttl)
    finally:
        assert backend.release(name, owner)


def test_holder_extras_changed_between_acquires_are_recorded_each_time(name: str) -> None:
    """The holder's host, pid and thread are cached by holder object; its extras are
    not: a context that changes them (a new dict, or the same dict changed in place)
    between two acquires on one thread records each acquire's own."""
    from distlocks import lock
    from distlocks.locks import holder_extra

    seen: list[dict[str, str]] = []
    same: dict[str, str] = {"step": "in-place-1"}
    for extra in ({"step": "one"}, {"step": "two"}, same, None):
        if extra is None:
            same["step"] = "in-place-2"
            extra = same
        token = holder_extra.set(extra)
        try:
            with lock(name, backend="pg", ttl=30, timeout=0):
                info = get_backend("pg").inspect(name)
                assert info is not None
                seen.append({"step": info.extra.get("step")})
        finally:
            holder_extra.reset(token)
    assert seen == [
        {"step": "one"},
        {"step": "two"},
        {"step": "in-place-1"},
        {"step": "in-place-2"},
    ]


def test_one_lock_object_takes_the_default_ttl_of_each_call(name: str) -> None:
    """Lock.acquire() now reads ``_ttl`` directly: a lock built without a ttl (a
    decorator at import) still takes DISTLOCKS_DEFAULT_TTL as it is at each acquire
    (override_settings), and the ttl text sent is the new one's."""
    from django.test import override_settings

    from distlocks import lock

    one = lock(name, backend="pg", timeout=0)
    recorded: list[float] = []
    for ttl in (17, 17.0, 42.5, 17):
        with override_settings(DISTLOCKS_DEFAULT_TTL=ttl), one as lease:
            with get_backend("pg")._pooled("inspect", name) as conn:  # type: ignore[attr-defined]
                row = conn.execute(
                    "SELECT ttl FROM distlocks_lockregistry WHERE name = %s", (name,)
                ).fetchone()
            assert row is not None and lease.held()
            recorded.append(row[0])
    assert recorded == [17.0, 17.0, 42.5, 17.0]
