"""The session lock cycle's fast path (issue 29): its statements prepared once per
connection and sent with psycopg.pq, without a cursor, and every guarantee of the
cursor path kept: the same bytes written, the same errors raised, the reply watchdog,
lost connections, statements dropped by DISCARD, psycopg's own prepared statements."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import lock
from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend, session, sql, wire
from distlocks.backends.postgres.keys import key_parts
from distlocks.backends.postgres.pool import Connection, NoAnswer
from distlocks.backends.postgres.wire import Statement, is_true, to_int, to_numbered
from distlocks.exceptions import LockBackendUnavailable, LockError
from tests.pg_backend import pg
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

UNLOCK = session.UNLOCK


@pytest.fixture
def conn() -> Iterator[Connection]:
    """A connection of the pool's class with the pool's settings, of the test's own."""
    made = Connection.connect(**pg()._connect_kwargs())
    made.reply_timeout = 5.0
    yield made
    made.close()


def prepared(conn: Connection) -> list[str]:
    rows = conn.execute("SELECT name FROM pg_prepared_statements ORDER BY name").fetchall()
    return [row[0] for row in rows]


def terminate(pid: int) -> bool:
    """End the server session ``pid``, waiting until it has ended."""
    with psycopg.connect(**pg()._connect_kwargs()) as killer:
        row = killer.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
    return bool(row and row[0])


def test_the_session_cycle_sends_no_statement_through_a_cursor(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with lock(name, backend="pg", timeout=0):  # a pooled connection, warm
        pass
    sent: list[str] = []
    real = psycopg.Cursor.execute

    def counted(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query)[:60])
        return real(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted)
    for _ in range(3):
        with lock(name, backend="pg", ttl=30, timeout=0, auto_renew=False) as lease:
            assert pg().extend(name, lease.owner, 30)
    assert sent == []


def test_each_statement_is_prepared_once_on_each_connection(name: str) -> None:
    backend = pg()
    for _ in range(4):
        with lock(name, backend="pg", ttl=30, timeout=0, auto_renew=False) as lease:
            lease.extend()
            conn = backend._held[lease.owner].conn
    names = prepared(conn)
    ours = [n for n in names if n.startswith("distlocks_")]
    assert sorted(ours) == ["distlocks_acquire_try", "distlocks_holds", "distlocks_unlock"]
    # Nothing of the cycle went through psycopg's own cache (its names are _pg3_*).
    assert [n for n in names if not n.startswith("distlocks_")] == []
    assert conn._fast_statements == {n.encode() for n in ours}


@pytest.mark.parametrize(
    "reset", ["DISCARD ALL", "DEALLOCATE ALL", "DEALLOCATE distlocks_acquire_try"]
)
def test_statements_dropped_on_the_server_are_prepared_again(name: str, reset: str) -> None:
    backend = pg()
    with lock(name, backend="pg", ttl=30, timeout=0, auto_renew=False) as lease:
        lease.extend()
        conn = backend._held[lease.owner].conn
    # Between leases (DISCARD ALL also frees a session's advisory locks).
    conn.execute(reset)
    assert "distlocks_acquire_try" not in prepared(conn)
    for _ in range(2):
        with lock(name, backend="pg", ttl=30, timeout=0, auto_renew=False) as lease:
            assert backend._held[lease.owner].conn is conn  # the same session again
            assert backend.extend(name, lease.owner, 30)
    assert "distlocks_acquire_try" in prepared(conn)


def test_psycopg_s_own_prepared_statements_live_beside_ours(conn: Connection) -> None:
    echo = Statement("distlocks_test_echo", "SELECT %(key)s::bigint + 0", to_int)
    for i in range(5):
        # prepare=True: psycopg prepares at once, under its own name.
        assert conn.execute("SELECT %s::bigint + 1", (i,), prepare=True).fetchone() == (i + 1,)
        assert conn.value(echo, {"key": i}) == i
    names = prepared(conn)
    assert "distlocks_test_echo" in names
    assert any(n.startswith("_pg3_") for n in names)
    # psycopg forgetting its own statements leaves ours alone, and the other way round.
    conn.execute("DEALLOCATE ALL")
    assert conn.value(echo, {"key": 7}) == 7
    assert conn.execute("SELECT %s::bigint + 1", (7,), prepare=True).fetchone() == (8,)


def test_each_thread_gets_its_own_statement_s_value(conn: Connection) -> None:
    echo = Statement("distlocks_test_echo", "SELECT %(key)s::bigint + 0", to_int)
    errors: list[BaseException] = []

    def ask(value: int) -> None:
        try:
            for _ in range(100):
                assert conn.value(echo, {"key": value}) == value
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_a_server_error_is_its_psycopg_class_and_the_connection_goes_on(
    conn: Connection,
) -> None:
    divide = Statement("distlocks_test_divide", "SELECT 1 / %(key)s::bigint", to_int)
    with pytest.raises(psycopg.errors.DivisionByZero) as excinfo:
        conn.value(divide, {"key": 0})
    with pytest.raises(psycopg.errors.DivisionByZero) as by_cursor:
        conn.fetchone("SELECT 1 / %(key)s::bigint", {"key": 0})
    assert str(excinfo.value) == str(by_cursor.value)
    assert excinfo.value.sqlstate == "22012"
    assert conn.value(divide, {"key": 2}) == 0
    missing = Statement("distlocks_test_missing", "SELECT count(*) FROM no_such_table", to_int)
    with pytest.raises(psycopg.errors.UndefinedTable):
        conn.value(missing, {})
    assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.parametrize("path", ["value", "fetchone"])
def test_a_connection_ended_by_the_server_is_an_operational_error(path: str) -> None:
    backend = pg()
    victim = backend.pool.get()
    try:
        holds = {"classid": 1, "objid": 2}
        assert victim.value(session.HOLDS, holds) is False
        assert terminate(victim.info.backend_pid)
        with pytest.raises(psycopg.OperationalError) as excinfo:
            if path == "value":
                victim.value(session.HOLDS, holds)
            else:
                victim.fetchone(sql.HOLDS, (1, 2))
        assert not isinstance(excinfo.value, NoAnswer)
        # Closed or not (libpq may not have read the end of the stream yet): a next
        # request is an OperationalError too, never an answer.
        with pytest.raises(psycopg.OperationalError):
            victim.value(session.HOLDS, holds)
    finally:
        backend.pool.put(victim)


def test_a_held_lease_whose_session_was_ended_is_lost_and_unavailable(name: str) -> None:
    backend = pg()
    lease = lock(name, backend="pg", ttl=30, auto_renew=False).acquire()
    pid = backend._held[lease.owner].conn.info.backend_pid
    assert terminate(pid)
    assert backend.extend(name, lease.owner, 30) is False
    assert backend.held_connection_count() == 0
    with lock(name, backend="pg", timeout=0) as again:
        assert again.held()


def test_the_watchdog_cuts_a_fast_request_the_server_does_not_answer(
    conn: Connection,
) -> None:
    conn.reply_timeout = 0.2
    sleep = Statement("distlocks_test_sleep", "SELECT true FROM pg_sleep(%(ttl)s)", is_true)
    assert conn.value(sleep, {"ttl": 0.0}) is True
    with pytest.raises(NoAnswer, match="socket_timeout"):
        conn.value(sleep, {"ttl": 60.0})
    with pytest.raises(psycopg.OperationalError):
        conn.value(sleep, {"ttl": 0.0})


def test_a_closed_connection_is_an_operational_error(conn: Connection) -> None:
    conn.close()
    with pytest.raises(psycopg.OperationalError, match="closed"):
        conn.value(session.HOLDS, {"classid": 1, "objid": 2})


# Any text, emoji, NUL and lone surrogates included, up to past the columns' widths.
_text = st.text(st.characters(codec=None), max_size=300)
_extra = st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=3)


def _outcome(backend: PostgresBackend, conn: Connection, run: Any, params: dict[str, Any]) -> Any:
    """The error class of ``run``, or the registry row it wrote (and the lock freed)."""
    try:
        token = run()
    except Exception as exc:
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
        return type(exc)
    assert token is not None
    row = conn.execute(
        "SELECT name, owner, host, pid, thread, ttl, extra, backend_pid = pg_backend_pid()"
        " FROM distlocks_lockregistry WHERE key = %s",
        (params["key"],),
    ).fetchone()
    unlock = {"key": params["key"], "reader": 0, "guard": 1}
    assert conn.value(UNLOCK, unlock) is True
    return row


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.text(st.characters(codec="utf-8"), max_size=300),
    host=_text,
    thread=_text,
    extra=_extra,
    pid=st.integers(0, 2**22),
)
def test_the_fast_path_writes_and_refuses_exactly_what_a_cursor_does(
    conn: Connection, name: str, host: str, thread: str, extra: dict[str, str], pid: int
) -> None:
    backend = pg()
    holder = Holder(host=host, pid=pid, thread=thread, extra=extra)
    params = backend._params(name, uuid.uuid4().hex, 12.5, holder)

    def by_cursor() -> Any:
        row = conn.fetchone(sql.ACQUIRE_TRY, params)
        return None if row is None else int(row[0])

    expected = _outcome(backend, conn, by_cursor, params)
    got = _outcome(backend, conn, lambda: conn.value(session.ACQUIRE_TRY, params), params)
    assert got == expected
    if isinstance(got, tuple):
        assert got[0] == name and got[6] == (json.loads(params["extra"]))


def test_a_name_with_emoji_and_a_long_name_round_trip(name: str) -> None:
    backend = pg()
    for each in (f"{name}:🔒 café ☃", f"{name}:" + "x" * (199 - len(name))):
        with lock(each, backend="pg", ttl=30, timeout=0) as lease:
            info = backend.inspect(each)
            assert (
                info is not None and info.name == each and info.fencing_token == lease.fencing_token
            )


def test_placeholders_become_numbered_parameters() -> None:
    assert to_numbered("SELECT %(a)s, %(b)s, %(a)s, '%%'") == (
        "SELECT $1, $2, $1, '%'",
        ("a", "b"),
    )
    assert to_numbered("SELECT %s = %s", ("x", "y")) == ("SELECT $1 = $2", ("x", "y"))
    with pytest.raises(ValueError):
        to_numbered("SELECT %s", ())
    with pytest.raises(ValueError):
        to_numbered("SELECT %s", ("x", "y"))
    with pytest.raises(ValueError):
        Statement("_pg3_9", "SELECT 1", to_int)
    assert session.ACQUIRE_TRY.params[0] == "key"
    assert session.HOLDS.types == [20, 20]


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(st.characters(codec="utf-8"), max_size=40),
    owner=_text,
    host=_text,
    thread=_text,
    extra=_extra,
    pid=st.integers(0, 2**31 - 1),
    ttl=st.one_of(st.floats(0.001, 1e6), st.integers(1, 10**6)),
)
def test_the_cached_encodings_are_what_encoding_each_call_gives(
    name: str, owner: str, host: str, thread: str, extra: dict[str, str], pid: int, ttl: float
) -> None:
    """The acquire try's parameters built from the per-name and per-holder caches are
    the bytes (or the error) that encoding the backend's parameter dict gives."""
    backend = pg()
    holder = Holder(host=host, pid=pid, thread=thread, extra=extra)

    def outcome(build: Any) -> Any:
        try:
            return build()
        except Exception as exc:
            return type(exc)

    def cached() -> Any:
        return backend._try_args(backend._named(name), owner, ttl, holder)

    expected = outcome(
        lambda: wire.values(session.ACQUIRE_TRY, backend._params(name, owner, ttl, holder), "utf-8")
    )
    assert outcome(cached) == expected
    assert outcome(cached) == expected  # from the caches this time
    if "\x00" in name:
        assert name not in backend._names  # a name that fails is never cached
        return
    named = backend._named(name)
    assert named.key == backend.key(name) and named.guard == backend._guard(name)
    unlock = {"key": named.key, "reader": 0, "guard": named.guard}
    assert named.unlock_args == wire.values(UNLOCK, unlock, "utf-8")
    classid, objid = key_parts(named.key)
    holds = {"classid": classid, "objid": objid}
    assert named.holds_args == wire.values(session.HOLDS, holds, "utf-8")


def test_a_connection_in_another_encoding_encodes_for_itself(name: str) -> None:
    """The values cached in UTF-8 are never sent on a connection of another client
    encoding: it gets them encoded in its own (or psycopg's error for a character
    its encoding lacks)."""
    backend = PostgresBackend("latin1", {"OPTIONS": {}})
    params = {**backend._connect_kwargs(), "client_encoding": "LATIN1"}
    backend._connect_kwargs = lambda: params  # type: ignore[method-assign]
    try:
        accented = f"{name}:café"
        owner = uuid.uuid4().hex
        holder = Holder(host="hôte", pid=1, thread="fil-é", extra={})
        assert backend.acquire(accented, owner, 30.0, holder).acquired
        held = backend._held[owner]
        assert not held.conn.utf8
        assert backend.extend(accented, owner, 30.0)
        info = pg().inspect(accented)
        assert info is not None and (info.name, info.host, info.thread) == (
            accented,
            "hôte",
            "fil-é",
        )
        assert backend.release(accented, owner)
        with pytest.raises(UnicodeEncodeError):
            backend.acquire(f"{name}:☃", uuid.uuid4().hex, 30.0, holder)
    finally:
        backend.close()


def test_the_name_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "NAMES_CACHED", 8)
    backend = PostgresBackend("bounded", {"OPTIONS": {}})
    for i in range(50):
        backend._named(f"name-{i}")
        assert len(backend._names) <= 8
    assert backend._named("name-49").key == backend.key("name-49")


@pytest.mark.parametrize("where", ["name", "thread", "extra"])
def test_a_nul_is_refused_as_a_lock_error_as_before(name: str, where: str) -> None:
    backend = pg()
    holder = Holder(
        host="h",
        pid=1,
        thread="t\x00" if where == "thread" else "t",
        extra={"k": "v\x00"} if where == "extra" else {},
    )
    bad = f"{name}\x00" if where == "name" else name
    with pytest.raises(LockError) as excinfo:
        backend.acquire(bad, uuid.uuid4().hex, 30.0, holder)
    if where == "extra":  # JSON escapes it: the server refuses it in jsonb
        assert "UntranslatableCharacter" in str(excinfo.value)
    else:
        assert "DataError: PostgreSQL text fields cannot contain NUL" in str(excinfo.value)
    assert backend.held_connection_count() == 0
    with lock(name, backend="pg", timeout=0) as lease:  # nothing was left locked
        assert lease.held()


def test_closing_a_connection_under_a_blocked_request_ends_the_request_first(
    conn: Connection,
) -> None:
    """libpq must never be freed under a call blocked on another thread (it read
    freed memory: "out of memory" errors, or worse): close() ends the call first."""
    conn.reply_timeout = None  # no watchdog: only close() can end the wait
    sleep = Statement("distlocks_test_sleep", "SELECT true FROM pg_sleep(%(ttl)s)", is_true)
    assert conn.value(sleep, {"ttl": 0.0}) is True
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            conn.value(sleep, {"ttl": 120.0})
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    wait_for(lambda: conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.ACTIVE,
             what="the request sent")  # fmt: skip
    conn.close()
    thread.join(60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], psycopg.OperationalError)
    assert "server closed the connection" in str(outcome[0])
    assert conn.closed


def test_a_server_error_on_acquire_is_a_lock_error_and_leaves_nothing_locked(
    name: str,
) -> None:
    """The registry refuses a name past its 200 characters after the statement took
    the advisory lock (a failed statement does not undo a session lock): the error is a
    LockError naming the server's error, and the connection that held it is gone."""
    backend = pg()
    long_name = f"{name}:" + "x" * 250
    with pytest.raises(LockError) as excinfo:
        backend.acquire(long_name, uuid.uuid4().hex, 30.0, Holder("h", 1, "t"))
    assert not isinstance(excinfo.value, LockBackendUnavailable)
    assert "StringDataRightTruncation" in str(excinfo.value)
    assert backend.held_connection_count() == 0
    with psycopg.connect(**backend._connect_kwargs()) as other:
        key = backend.key(long_name)
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
