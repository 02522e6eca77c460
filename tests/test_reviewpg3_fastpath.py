"""Review of the PostgreSQL fast path (named prepared statements sent with psycopg.pq)
and of migration 0004's mint, by attack: an exception raised asynchronously in the
middle of a lock statement (Ctrl-C, a Celery soft time limit, a SIGALRM timeout),
names that fill and evict the per-name cache, odd holder metadata, and the
migration taken back and forth under live rows."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend, session, sql, wire
from distlocks.backends.postgres.pool import Connection
from distlocks.exceptions import LockBackendUnavailable, LockError
from tests.waiting import run_threads, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

HOLDER = Holder(host="h", pid=1, thread="t")


@pytest.fixture
def backend() -> Iterator[PostgresBackend]:
    """A backend of the test's own (its own pool: no statement prepared yet)."""
    made = PostgresBackend("reviewpg3", {"OPTIONS": {}})
    yield made
    made.close()


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt (or Celery's soft time limit): raised by a signal
    handler between two bytecodes, whatever the code was doing."""


def _interrupt(
    monkeypatch: pytest.MonkeyPatch, call: str, statement: bytes, when: str
) -> list[bool]:
    """The next libpq ``call`` ("prepare" or "exec_prepared") of ``statement`` is
    interrupted ``when`` ("before" it is sent, or "after" the server answered)."""
    real = Connection._request
    fired: list[bool] = []

    def request(self: Connection, send: Any, *args: Any) -> Any:
        if not fired and send.__name__ == call and args[0] == statement:
            fired.append(True)
            if when == "before":
                raise Interrupted
            real(self, send, *args)
            raise Interrupted
        return real(self, send, *args)

    monkeypatch.setattr(Connection, "_request", request)
    return fired


def _free(backend: PostgresBackend, name: str) -> bool:
    with psycopg.connect(**backend._connect_kwargs()) as other:
        # Unlocked before the connection closes: the server ends a closed session
        # (and frees its locks) only some time after the client has gone.
        row = other.execute(
            "SELECT pg_try_advisory_lock(%(key)s) AND pg_advisory_unlock(%(key)s)",
            {"key": backend.key(name)},
        ).fetchone()
        return bool(row and row[0])


def _nothing_checked_out(backend: PostgresBackend) -> bool:
    pool = backend.pool
    with pool._lock:
        return pool._count == len(pool._idle) + backend.held_connection_count()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("call", ["prepare", "exec_prepared"])
def test_an_interrupted_renewal_ping_leaves_the_lease_held(
    backend: PostgresBackend, name: str, monkeypatch: pytest.MonkeyPatch, call: str, when: str
) -> None:
    owner = uuid.uuid4().hex
    assert backend.acquire(name, owner, 30.0, HOLDER).acquired
    if call == "exec_prepared":  # prepared by an earlier renewal
        assert backend.extend(name, owner, 30.0)
    fired = _interrupt(monkeypatch, call, session.HOLDS.name, when)
    with pytest.raises(Interrupted):
        backend.extend(name, owner, 30.0)
    assert fired
    monkeypatch.undo()
    # The interrupt said nothing about the lock: its session still holds it.
    assert backend.extend(name, owner, 30.0)
    assert backend.held_connection_count() == 1
    assert not _free(backend, name)
    assert backend.release(name, owner)
    assert _free(backend, name)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("call", ["prepare", "exec_prepared"])
def test_an_interrupted_release_leaves_no_connection_out_and_the_lock_free(
    backend: PostgresBackend, name: str, monkeypatch: pytest.MonkeyPatch, call: str, when: str
) -> None:
    if call == "exec_prepared":  # the unlock statement prepared on the pool's connection
        first = uuid.uuid4().hex
        assert backend.acquire(name, first, 30.0, HOLDER).acquired
        assert backend.release(name, first)
    owner = uuid.uuid4().hex
    assert backend.acquire(name, owner, 30.0, HOLDER).acquired
    fired = _interrupt(monkeypatch, call, session.UNLOCK.name, when)
    with pytest.raises(Interrupted):
        backend.release(name, owner)
    assert fired
    monkeypatch.undo()
    assert backend.held_connection_count() == 0
    # The connection went back to the pool or was closed: none is lost to the pool.
    assert _nothing_checked_out(backend)
    wait_for(lambda: _free(backend, name), what="the lock free after the interrupted release")
    # And the pool's connections still lock and unlock.
    for _ in range(3):
        again = uuid.uuid4().hex
        assert backend.acquire(name, again, 30.0, HOLDER).acquired
        assert backend.extend(name, again, 30.0)
        assert backend.release(name, again)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("call", ["prepare", "exec_prepared"])
def test_an_interrupted_acquire_leaves_no_lock_and_no_connection_out(
    backend: PostgresBackend, name: str, monkeypatch: pytest.MonkeyPatch, call: str, when: str
) -> None:
    if call == "exec_prepared":
        first = uuid.uuid4().hex
        assert backend.acquire(name, first, 30.0, HOLDER).acquired
        assert backend.release(name, first)
    fired = _interrupt(monkeypatch, call, session.ACQUIRE_TRY.name, when)
    with pytest.raises(Interrupted):
        backend.acquire(name, uuid.uuid4().hex, 30.0, HOLDER)
    assert fired
    monkeypatch.undo()
    assert backend.held_connection_count() == 0
    assert _nothing_checked_out(backend)
    assert _free(backend, name)
    owner = uuid.uuid4().hex
    assert backend.acquire(name, owner, 30.0, HOLDER).acquired
    assert backend.release(name, owner)


# Names that share long prefixes (they differ only in their last characters), reach
# the registry's 200 characters, or are made of characters outside the BMP.
_names = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20),
    st.builds(
        lambda tail: "p" * 190 + tail,
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=10),
    ),
    st.text(st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF), min_size=1, max_size=50),
    st.integers(0, 5_000).map(lambda i: f"entity:{i}"),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(names=st.lists(_names, min_size=1, max_size=300))
def test_the_name_cache_never_hands_a_name_another_s_bytes(
    monkeypatch: pytest.MonkeyPatch, names: list[str]
) -> None:
    """Whatever the order of names and however often the bounded cache is emptied,
    what the fast path sends for a name is what encoding that name alone gives."""
    monkeypatch.setattr(session, "NAMES_CACHED", 7)
    cached = PostgresBackend("reviewpg3-cache", {"OPTIONS": {}})
    owner = "o" * 32
    for name in names * 2:  # every name again, after evictions
        fresh = PostgresBackend("reviewpg3-fresh", {"OPTIONS": {}})
        named = cached._named(name)
        assert len(cached._names) <= 7
        assert named.key == fresh.key(name) and named.guard == fresh._guard(name)
        expected = wire.values(
            session.ACQUIRE_TRY, fresh._params(name, owner, 30.0, HOLDER), "utf-8"
        )
        assert cached._try_args(named, owner, 30.0, HOLDER) == expected
        unlock = {"key": named.key, "reader": 0, "guard": named.guard}
        assert named.unlock_args == wire.values(session.UNLOCK, unlock, "utf-8")


def test_five_thousand_names_through_the_bounded_cache() -> None:
    """More names than the cache holds (4,096): each one's key and bytes are its own."""
    backend = PostgresBackend("reviewpg3-many", {"OPTIONS": {}})
    names = [f"entity:{i}" for i in range(5_000)] + [f"entity:{i}" for i in range(0, 5_000, 7)]
    for name in names:
        named = backend._named(name)
        assert named.key == backend.key(name)
        assert named.try_args[session._NAME] == name.encode()
    assert len(backend._names) <= session.NAMES_CACHED


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    extra=st.one_of(
        st.dictionaries(st.text(max_size=10), _json, max_size=5),
        st.builds(lambda n: {"big": "€😀" * n}, st.integers(10_000, 40_000)),
        st.sampled_from([{"nan": float("nan")}, {"lone": "\ud800"}, {"nul": "a\x00"}]),
    )
)
def test_odd_holder_extra_is_stored_as_json_or_refused_as_a_lock_error(
    backend: PostgresBackend, name: str, extra: dict[str, Any]
) -> None:
    """Nested, unicode (lone surrogates, NULs), big or not JSON at all (NaN): written
    as json.dumps gives it, or refused by the server as a LockError that leaves no
    lock and no connection behind."""
    holder = Holder(host="h", pid=1, thread="t", extra=extra)
    owner = uuid.uuid4().hex
    refused: LockError | None = None
    try:
        acquired = backend.acquire(name, owner, 30.0, holder).acquired
    except LockError as exc:
        refused = exc
    if refused is not None:
        assert not isinstance(refused, LockBackendUnavailable)
        assert backend.held_connection_count() == 0
        assert _nothing_checked_out(backend)
        assert _free(backend, name)
        with psycopg.connect(**backend._connect_kwargs()) as check:  # the server refuses it
            with pytest.raises(psycopg.Error):
                check.execute("SELECT %s::jsonb", (json.dumps(extra),))
        return
    assert acquired
    try:
        with psycopg.connect(**backend._connect_kwargs()) as check:
            row = check.execute(
                "SELECT extra FROM distlocks_lockregistry WHERE key = %s", (backend.key(name),)
            ).fetchone()
        assert row is not None and row[0] == json.loads(json.dumps(extra))
    finally:
        assert backend.release(name, owner)


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """The server process ``pid`` stopped (SIGSTOP): its socket stays open and its
    kernel still acknowledges, but nothing answers; resumed afterwards."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except PermissionError:
        pytest.skip("the server's processes belong to another user")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _bounded(call: Any, limit: float = 60.0) -> Any:
    """``call()``'s result or exception, failing if it is still blocked after ``limit``
    seconds (a hang, not a slow machine: the bound is ten times the socket timeout)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still blocked after {limit} s"
    return outcome[0]


def test_a_frozen_server_session_is_cut_on_every_fast_statement(name: str) -> None:
    """SIGSTOP on the server process behind a held lease's connection and behind an
    idle pooled one: the renewal ping says the lease is lost, the release says
    nothing was released, an acquire on the frozen connection is
    LockBackendUnavailable; each within the socket timeout, none hangs, and the pool
    is whole afterwards."""
    backend = PostgresBackend("reviewpg3-frozen", {"OPTIONS": {"socket_timeout": 1.0}})
    try:
        owner, other = uuid.uuid4().hex, uuid.uuid4().hex
        assert backend.acquire(name, owner, 30.0, HOLDER).acquired
        assert backend.extend(name, owner, 30.0)  # every statement prepared
        assert backend.acquire(f"{name}:2", other, 30.0, HOLDER).acquired
        assert backend.release(f"{name}:2", other)  # an idle connection, prepared
        held = backend._held[owner].conn.info.backend_pid
        with _frozen(held):
            assert _bounded(lambda: backend.extend(name, owner, 30.0)) is False
        assert backend.held_connection_count() == 0
        # Resumed, the server sees the connection closed and frees the lock.
        wait_for(lambda: _free(backend, name), what="the frozen holder's lock freed")
        idle = backend.pool._idle[-1]
        with _frozen(idle.info.backend_pid):
            outcome = _bounded(lambda: backend.acquire(f"{name}:3", other, 30.0, HOLDER))
        assert isinstance(outcome, LockBackendUnavailable), outcome
        assert "socket_timeout" in str(outcome)
        assert _nothing_checked_out(backend)
        lease = uuid.uuid4().hex
        assert backend.acquire(f"{name}:3", lease, 30.0, HOLDER).acquired
        held = backend._held[lease].conn.info.backend_pid
        with _frozen(held):
            assert _bounded(lambda: backend.release(f"{name}:3", lease)) is False
        assert _nothing_checked_out(backend)
    finally:
        backend.close()


def _chain(exc: BaseException | None) -> str:
    """Every message of ``exc`` and the errors chained to it."""
    seen = []
    while exc is not None and len(seen) < 10:
        seen.append(f"{type(exc).__name__}: {exc} {exc.args!r}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(seen)


def test_no_error_of_the_fast_path_shows_the_password(name: str) -> None:
    """A password in the connection settings (the test server trusts any) never
    appears in what a cut request, a lost connection or an unreachable server
    raises, nor in anything chained to it."""
    secret = "pw-" + uuid.uuid4().hex
    backend = PostgresBackend("reviewpg3-secret", {"OPTIONS": {"socket_timeout": 1.0}})
    params = {**backend._connect_kwargs(), "password": secret}
    backend._connect_kwargs = lambda: params  # type: ignore[method-assign]
    errors: list[BaseException] = []
    try:
        owner = uuid.uuid4().hex
        assert backend.acquire(name, owner, 30.0, HOLDER).acquired
        assert backend.release(name, owner)
        idle = backend.pool._idle[-1]
        with _frozen(idle.info.backend_pid):  # a request cut by the watchdog
            errors.append(_bounded(lambda: backend.acquire(name, owner, 30.0, HOLDER)))
        backend.close()
        params["port"] = 1  # nothing listens there
        errors.append(_bounded(lambda: backend.acquire(name, owner, 30.0, HOLDER)))
    finally:
        backend.close()
    assert all(isinstance(exc, LockBackendUnavailable) for exc in errors), errors
    for exc in errors:
        assert secret not in _chain(exc)


def test_a_refused_registry_write_in_transaction_mode_leaves_no_lock(name: str) -> None:
    """A name past the registry's 200 characters is refused after the transaction-level
    lock was granted: the acquisition is a LockError, the caller's transaction goes on,
    and it does not hold the lock (a savepoint took it back)."""
    from django.db import connection, transaction

    backend = PostgresBackend("reviewpg3-xact", {"OPTIONS": {"mode": "transaction"}})
    long_name = f"{name}:" + "x" * 250
    try:
        with transaction.atomic():
            with pytest.raises(LockError, match="StringDataRightTruncation"):
                backend.acquire(long_name, uuid.uuid4().hex, 30.0, HOLDER)
            assert _free(backend, long_name)
            with connection.cursor() as cursor:  # the transaction is still usable
                cursor.execute("SELECT 1")
                assert cursor.fetchone() == (1,)
            owner = uuid.uuid4().hex
            assert backend.acquire(name, owner, 30.0, HOLDER).acquired
            assert not _free(backend, name)
        assert _free(backend, name)
    finally:
        backend.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_prepares_on_connections_of_its_own(
    backend: PostgresBackend, name: str
) -> None:
    """Forked while the parent's pool has an idle connection with every statement
    prepared and a held lease: the child's locks run on sessions of its own (each
    preparing its statements), it cannot take the parent's lock, and the parent's
    connections are untouched (the idle one still prepared, the lease still held)."""
    mine, free = uuid.uuid4().hex, f"{name}:free"
    assert backend.acquire(name, mine, 30.0, HOLDER).acquired
    first = uuid.uuid4().hex
    assert backend.acquire(free, first, 30.0, HOLDER).acquired
    assert backend.extend(free, first, 30.0)
    assert backend.release(free, first)
    idle = backend.pool._idle[-1]
    assert idle._fast_statements == {
        session.ACQUIRE_TRY.name,
        session.HOLDS.name,
        session.UNLOCK.name,
    }
    parent_pids = {idle.info.backend_pid, backend._held[mine].conn.info.backend_pid}
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child = uuid.uuid4().hex
            assert backend.held_connection_count() == 0
            assert not backend.acquire(name, child, 30.0, HOLDER).acquired
            assert backend.acquire(free, child, 30.0, HOLDER).acquired
            conn = backend._held[child].conn
            assert conn.info.backend_pid not in parent_pids
            assert backend.extend(free, child, 30.0)
            assert conn._fast_statements == {
                session.ACQUIRE_TRY.name,
                session.HOLDS.name,
            }
            assert backend.release(free, child)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.extend(name, mine, 30.0)
    assert not _free(backend, name)
    again = uuid.uuid4().hex
    assert backend.acquire(free, again, 30.0, HOLDER).acquired
    assert backend._held[again].conn is idle  # the same session, not ended by the child
    assert backend.release(free, again)
    assert backend.release(name, mine)


@pytest.mark.parametrize("path", ["value", "fetchone"])
def test_an_interrupt_as_a_request_is_watched_leaves_no_deadline_behind(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Interrupted just after the request registered its deadline with the reply
    watchdog, before it was sent: the deadline is dropped with it, or the watchdog
    would shut down the (healthy) connection a socket timeout later, and with it
    whatever lease it holds by then."""
    from distlocks.backends.postgres import pool

    conn = Connection.connect(**PostgresBackend("w", {"OPTIONS": {}})._connect_kwargs())
    conn.reply_timeout = 5.0
    real = pool.watchdog.watch

    def watch(watched: Connection, deadline: float) -> None:
        real(watched, deadline)
        if watched is conn:
            raise Interrupted

    try:
        monkeypatch.setattr(pool.watchdog, "watch", watch)
        with pytest.raises(Interrupted):
            if path == "value":
                conn.value(session.HOLDS, {"classid": 1, "objid": 2})
            else:
                conn.fetchone(sql.HOLDS, (1, 2))
        monkeypatch.undo()
        assert id(conn) not in pool.watchdog._watched
        assert conn.value(session.HOLDS, {"classid": 1, "objid": 2}) is False
    finally:
        conn.close()


def test_force_release_races_release_and_reacquire_on_the_fast_path(name: str) -> None:
    """One thread takes, renews and gives back the lock over and over (its next lease
    usually on the same session, the pool being LIFO); another force-releases it by
    tokens it saw: mostly earlier ones, which must never evict anyone, sometimes the
    current one. Every lease found lost was one evicted by its own token."""
    holder_side = PostgresBackend("reviewpg3-holder", {"OPTIONS": {}})
    operator = PostgresBackend("reviewpg3-operator", {"OPTIONS": {}})
    issued: list[int] = []
    lost: list[int] = []
    evicted: list[int] = []
    stale_evictions: list[int] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            for _ in range(150):
                owner = uuid.uuid4().hex
                result = holder_side.acquire(name, owner, 30.0, HOLDER)
                if not result.acquired:
                    continue  # the operator's eviction is still under way
                issued.append(result.fencing_token)
                renewed = holder_side.extend(name, owner, 30.0)
                released = holder_side.release(name, owner)
                if not (renewed and released):
                    lost.append(result.fencing_token)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def operate() -> None:
        try:
            turn = 0
            while not done.is_set():
                turn += 1
                if len(issued) < 2:
                    continue
                if turn % 4 == 0:
                    token = issued[-1]
                    if operator.force_release(name, token):
                        evicted.append(token)
                else:
                    token = issued[-2]  # an earlier lease: never evicts anyone
                    if operator.force_release(name, token):
                        stale_evictions.append(token)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hold), threading.Thread(target=operate)]
    try:
        run_threads(threads, 120)
    finally:
        done.set()
        holder_side.close()
        operator.close()
    assert errors == []
    assert len(issued) > 50 and issued == sorted(set(issued))
    # The next to last token names a lease already given back: it evicts no one.
    assert stale_evictions == []
    assert set(lost) <= set(evicted), (lost, evicted)
