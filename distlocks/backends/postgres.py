"""PostgreSQL advisory-lock backend.

Locks are PostgreSQL advisory locks on a 64-bit key derived from the lock name
with SHA-256 (never crc32 or ``hashtext``, which collide). The
``distlocks_lockregistry`` table (a migration of this app) maps keys back to
names and keeps the durable, strictly increasing per-name fencing counter.
Taking the lock and bumping the counter is one SQL statement, and the counter
moves only when the lock was granted.

Two modes (``OPTIONS["mode"]``):

``"session"`` (default)
    A session-level lock on a connection of a small pool kept apart from
    Django's request connections; the connection is pinned to the lease until
    release, so Django closing or reusing its own connections never drops a
    lock. The server frees the lock when that connection ends (a crashed
    holder frees it as soon as the server sees the connection close). Not
    usable behind a transaction-pooling proxy such as PgBouncer in transaction
    mode: declare one with ``OPTIONS["pooler"] = "transaction"`` and the
    ``distlocks.E009`` check will say so.

``"transaction"``
    A transaction-level lock taken on Django's own connection inside
    ``transaction.atomic()``; it ends at COMMIT or ROLLBACK, and is safe
    behind transaction pooling. ``release()`` cannot end it early.

Waiting uses the server's own lock queue (``pg_advisory_lock`` under a
``lock_timeout``), so waiters are served in arrival order with no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction

from distlocks.backends.base import (
    READ,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
    holder_details,
    permit_family,
)
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact_exception

try:
    import psycopg
    import psycopg.errors
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.postgres.PostgresBackend needs psycopg 3: "
        "pip install 'distlocks[postgres]'."
    ) from exc

logger = logging.getLogger(__name__)

TABLE = "distlocks_lockregistry"
MODES = ("session", "transaction")

# Tokens are floored by the server clock in microseconds, like the other backends,
# so that they stay comparable and survive a registry that was emptied.
_CLOCK_US = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"

# The registry upsert shared by both modes; {lock} is a query taking the lock and
# yielding one boolean "ok". The upsert runs only if the lock was granted, and
# bumps the counter in the same statement.
_ACQUIRE = f"""
WITH granted AS MATERIALIZED ({{lock}})
INSERT INTO {TABLE} AS r
    (key, name, fencing_token, owner, host, pid, thread, backend_pid,
     acquired_at, ttl, renewals, extra)
SELECT %(key)s, %(name)s, {_CLOCK_US}, %(owner)s, %(host)s, %(pid)s, %(thread)s,
       pg_backend_pid(), clock_timestamp(), %(ttl)s, 0, %(extra)s
FROM granted WHERE granted.ok
ON CONFLICT (key) DO UPDATE SET
    fencing_token = greatest(r.fencing_token + 1, EXCLUDED.fencing_token),
    name = EXCLUDED.name, owner = EXCLUDED.owner,
    host = EXCLUDED.host, pid = EXCLUDED.pid, thread = EXCLUDED.thread,
    backend_pid = EXCLUDED.backend_pid, acquired_at = EXCLUDED.acquired_at,
    ttl = EXCLUDED.ttl, renewals = 0, extra = EXCLUDED.extra
RETURNING r.fencing_token
"""

# Live advisory locks of this database (classid/objid are the high/low 32 bits of
# the bigint key ``lkey``), joined with the registry and the holder's session:
# exclusive holders (locks, write leases, semaphore slots) with the row of their
# key; shared holders (read leases) with their own row, found by name through the
# read-write lock's row and by session. Callers append "AND ..." conditions.
_LIVE = """(
    SELECT pid, database, classid, objid, mode,
           ((classid::bigint << 32) | objid::bigint) AS lkey
    FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)"""
_COLUMNS = """r.name, r.owner, r.fencing_token, r.host, r.pid, r.thread, r.acquired_at, r.ttl,
       r.renewals, r.extra, l.pid AS backend_pid, r.backend_pid AS row_pid, a.application_name,
       host(a.client_addr) AS client_addr, a.state, a.state_change, l.lkey, l.mode,
       (SELECT count(*) FROM waiting w
         WHERE w.classid = l.classid AND w.objid = l.objid) AS waiters"""
# The waiting requests are read from pg_locks once per query: a subquery on pg_locks
# itself would copy the server's whole lock table once per live lock (quadratic).
_LOCKS = f"""
WITH waiting AS MATERIALIZED (
    SELECT classid, objid FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND NOT granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
SELECT * FROM (
    SELECT {_COLUMNS}
    FROM {_LIVE} l
    JOIN {TABLE} r ON r.key = l.lkey
    LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.mode = 'ExclusiveLock'
  UNION ALL
    SELECT {_COLUMNS}
    FROM {_LIVE} l
    JOIN {TABLE} rw ON rw.key = l.lkey
    JOIN {TABLE} r ON r.name = rw.name AND r.backend_pid = l.pid
      AND r.extra->>'kind' = 'read' AND r.extra->>'of' = l.lkey::text
    LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.mode = 'ShareLock'
) AS live WHERE true
"""

TRY = "SELECT pg_try_advisory_lock(%(key)s) AS ok"
WAIT = "SELECT true AS ok FROM (SELECT pg_advisory_lock(%(key)s)) AS waited"
TRY_SHARED = "SELECT pg_try_advisory_lock_shared(%(key)s) AS ok"
WAIT_SHARED = "SELECT true AS ok FROM (SELECT pg_advisory_lock_shared(%(key)s)) AS waited"
# Every statement that gives a lock back first takes the name's guard key, shared and
# until the statement ends: a force release holds it exclusively while it checks who
# holds the lock and ends that session, so the holder it checked cannot give the lock
# back and move on to another lease on the same connection in between.
_UNLOCK = (
    "SELECT pg_advisory_unlock(%(key)s)"
    " FROM (SELECT pg_advisory_xact_lock_shared(%(guard)s)) AS guarded"
)

# -- semaphores and read-write locks (session mode). Their registry rows say what
# they belong to in extra: "kind" and "of" (the id of the semaphore or read-write
# lock, a key derived from its name, as text).

# A holder's registry row, for {source} rows with the columns key and extra.
_PERMIT_ROW = f"""
INSERT INTO {TABLE} AS r
    (key, name, fencing_token, owner, host, pid, thread, backend_pid,
     acquired_at, ttl, renewals, extra)
SELECT source.key, %(name)s, 0, %(owner)s, %(host)s, %(pid)s, %(thread)s,
       pg_backend_pid(), clock_timestamp(), %(ttl)s, 0, source.extra
FROM {{source}} AS source
ON CONFLICT (key) DO UPDATE SET
    name = EXCLUDED.name, owner = EXCLUDED.owner,
    host = EXCLUDED.host, pid = EXCLUDED.pid, thread = EXCLUDED.thread,
    backend_pid = EXCLUDED.backend_pid, acquired_at = EXCLUDED.acquired_at,
    ttl = EXCLUDED.ttl, renewals = 0, extra = EXCLUDED.extra
"""

# A semaphore of N permits is N advisory-lock slots: try them in order, stopping at
# the first one granted (a recursive query goes on only while none was), and record
# the holder on the slot's row. Returns the slot's key when one was free.
_SEM_ACQUIRE = (
    """
WITH RECURSIVE slots(i, ok) AS (
    SELECT 1, pg_try_advisory_lock((%(keys)s::bigint[])[1])
  UNION ALL
    SELECT i + 1, pg_try_advisory_lock((%(keys)s::bigint[])[i + 1])
    FROM slots WHERE NOT ok AND i < %(limit)s
), granted AS MATERIALIZED (
    SELECT (%(keys)s::bigint[])[i] AS key,
           %(extra)s::jsonb || jsonb_build_object('slot', i - 1) AS extra
    FROM slots WHERE ok
)
"""
    + _PERMIT_ROW.format(source="granted")
    + "RETURNING r.key"
)

# The write side: the lock's own statement on the read-write lock's key (its row
# keeps the write fencing counter), which also drops the rows of readers: none can
# hold the lock while the writer does, so any left are those of crashed readers.
_WRITE_ACQUIRE = _ACQUIRE.replace(
    "WITH granted AS MATERIALIZED ({lock})",
    f"""WITH granted AS MATERIALIZED ({{lock}}), cleared AS (
    DELETE FROM {TABLE}
    WHERE name = %(name)s AND extra->>'kind' = 'read' AND extra->>'of' = %(of)s
      AND EXISTS (SELECT 1 FROM granted WHERE granted.ok)
)""",
)
assert "cleared" in _WRITE_ACQUIRE

# The read side: a shared lock on the same key, and a row of the reader's own (the
# lock's row, created if missing, is where the listing finds it by name). A row of
# an earlier reader on this same session is stale: a session holds one lease.
_READ_ACQUIRE = (
    f"""
WITH granted AS MATERIALIZED ({{lock}}), anchor AS (
    INSERT INTO {TABLE} (key, name, fencing_token, owner, host, thread, renewals, extra)
    SELECT %(key)s, %(name)s, 0, '', '', '', 0,
           jsonb_build_object('kind', 'write', 'of', %(of)s::text)
    FROM granted WHERE granted.ok
    ON CONFLICT (key) DO NOTHING
), stale AS (
    DELETE FROM {TABLE}
    WHERE name = %(name)s AND extra->>'kind' = 'read' AND extra->>'of' = %(of)s
      AND backend_pid = pg_backend_pid() AND key <> %(reader)s
      AND EXISTS (SELECT 1 FROM granted WHERE granted.ok)
), reader AS (
    SELECT %(reader)s::bigint AS key, %(extra)s::jsonb AS extra
    FROM granted WHERE granted.ok
), mine AS ("""
    + _PERMIT_ROW.format(source="reader")
    + """RETURNING 1
)
SELECT 0 FROM granted WHERE granted.ok
"""
)
_READ_UNLOCK = f"""
WITH guarded AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(%(guard)s)),
gone AS (DELETE FROM {TABLE} WHERE key = %(reader)s)
SELECT pg_advisory_unlock_shared(%(key)s) FROM guarded
"""

# The sessions holding permits of one semaphore or read-write lock (one owner's, or
# all), each listed with its own registry row (a row still naming an earlier session is
# an acquire in flight, not a holder).
_PERMIT_TARGETS = f"""
SELECT DISTINCT backend_pid FROM ({_LOCKS}
    AND extra->>'of' = %(of)s AND (%(owner)s::text IS NULL OR owner = %(owner)s)
    AND row_pid = backend_pid
) AS held
"""
# Ends sessions and waits (up to 5 s) until each has ended, so what they held is free
# on return. Returns how many were ended (PostgreSQL 14+, as Django).
_TERMINATE = (
    "SELECT count(*) FILTER (WHERE ok) FROM"
    " (SELECT pg_terminate_backend(pid, 5000) AS ok FROM unnest(%(pids)s::integer[]) AS pid)"
    " AS ended"
)
_BUMP = f"""
UPDATE {TABLE} SET fencing_token = greatest(fencing_token + 1, {{clock}})
WHERE key = %(key)s
""".format(clock=_CLOCK_US)
_HOLDER = """
SELECT l.pid FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(classid)s AND l.objid = %(objid)s
"""
TRY_XACT = "SELECT pg_try_advisory_xact_lock(%(key)s) AS ok"
# Transaction mode's registry write, on a pooled connection once the caller's
# transaction holds the lock: the holder's session is the caller's, not this one.
_REGISTER_XACT = _ACQUIRE.format(lock="SELECT true AS ok").replace(
    "pg_backend_pid()", "%(backend_pid)s"
)
# The uncontended acquire, built once (it runs on every try).
_ACQUIRE_TRY = _ACQUIRE.format(lock=TRY)
WAIT_XACT = "SELECT true AS ok FROM (SELECT pg_advisory_xact_lock(%(key)s)) AS waited"

# Transaction mode: the holder's lock lives in its transaction, which gives it back at
# COMMIT; no statement of ours runs there to wait for a guard. The check (the
# registry's token is the one shown) and the signal are one statement; the counter
# moves only if a session was ended. The holder's own registry write commits with its
# transaction, so the row read here, like the listing, is the last committed one.
_FORCE_RELEASE_XACT = f"""
WITH registered AS MATERIALIZED (
    SELECT fencing_token, backend_pid FROM {TABLE} WHERE key = %(key)s
), holder AS MATERIALIZED ({_HOLDER}
      AND (%(token)s::bigint IS NULL OR EXISTS (
          SELECT 1 FROM registered WHERE registered.fencing_token = %(token)s))
), killed AS MATERIALIZED (
    SELECT pg_terminate_backend(pid, 5000) AS ok FROM holder
), bumped AS (
    UPDATE {TABLE} SET fencing_token = greatest(fencing_token + 1, {_CLOCK_US})
    WHERE key = %(key)s AND EXISTS (SELECT 1 FROM killed WHERE ok) RETURNING 1
)
SELECT coalesce(bool_or(ok), false) FROM killed
"""


@functools.lru_cache(maxsize=4096)
def lock_key(prefix: str, name: str) -> int:
    """The signed 64-bit advisory-lock key of ``name`` under ``prefix`` (SHA-256;
    cached: a name is usually locked again, and each acquire needs two keys)."""
    digest = hashlib.sha256(f"{prefix}\x00{name}".encode()).digest()
    return int(struct.unpack(">q", digest[:8])[0])


@functools.lru_cache(maxsize=1024)
def _slot_keys(prefix: str, name: str, limit: int) -> list[int]:
    """The advisory-lock keys of a semaphore's slots (cached: waiters poll with them)."""
    return [lock_key(prefix, f"{name}\x00{SEMAPHORE}\x00{slot}") for slot in range(limit)]


def key_parts(key: int) -> tuple[int, int]:
    """``(classid, objid)`` as ``pg_locks`` shows a bigint key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


class NoAnswer(psycopg.OperationalError):
    """The server did not answer a request in time; the connection was cut."""


class _Watchdog:
    """Cuts the connections whose server stopped answering.

    libpq waits for a reply as long as the TCP connection lives, and a server that is
    stopped, frozen or behind a silent network keeps it alive (its kernel, or a proxy
    in between, still acknowledges): keepalives and ``tcp_user_timeout`` never fire.
    Each request registers its deadline here; one thread shuts down the socket of a
    request still unanswered at its deadline, which ends libpq's wait at once with an
    error. The connection is then unusable, and the server frees its locks when it
    sees it closed."""

    TICK = 0.1

    def __init__(self) -> None:
        self._watched: dict[int, tuple[float, _Connection]] = {}
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # True while the thread sleeps with no timeout (nothing watched for a tick):
        # only then does a new request wake it. While it ticks, it finds the request
        # at its next tick, within TICK of any deadline, and a busy client does not
        # pay a thread wake-up (two switches of the interpreter lock) per statement.
        self._asleep = True
        # Requests registered since the thread last looked: a quiet tick first.
        self._requests = 0

    def watch(self, conn: _Connection, deadline: float) -> None:
        self._watched[id(conn)] = (deadline, conn)
        self._requests += 1
        if self._thread is None:
            self._start()
        if self._asleep:
            self._wake.set()

    def unwatch(self, conn: _Connection) -> None:
        self._watched.pop(id(conn), None)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="distlocks-pg-watchdog")
                thread.daemon = True
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        seen = -1
        while True:
            if not self._watched and self._requests == seen:
                # A whole tick without a request: sleep until the next one. Cleared
                # and marked before looking again, so that a request registered in
                # between either is seen here or sets the event.
                self._wake.clear()
                self._asleep = True
                if not self._watched:
                    self._wake.wait()
                self._asleep = False
            seen = self._requests
            now = time.monotonic()
            for key, entry in list(self._watched.items()):
                # The same registration still (not the connection's next request).
                if entry[0] <= now and self._watched.get(key) is entry:
                    self._watched.pop(key, None)
                    entry[1].cut()
            time.sleep(self.TICK)

    def after_fork(self) -> None:
        self._watched = {}
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread = None
        self._asleep = True
        self._requests = 0


_watchdog = _Watchdog()


class _Connection(psycopg.Connection[Any]):
    """A connection whose every request waits at most ``reply_timeout`` seconds for
    the server (plus ``lock_wait`` while a lock wait is under way): see
    :class:`_Watchdog`."""

    reply_timeout: float | None = None
    lock_wait: float = 0.0
    _cut = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self.reply_timeout is None:
            return super().wait(*args, **kwargs)
        _watchdog.watch(self, time.monotonic() + self.reply_timeout + self.lock_wait)
        try:
            result = super().wait(*args, **kwargs)
        except psycopg.OperationalError as exc:
            if self._cut:
                raise self._no_answer() from exc
            raise
        finally:
            _watchdog.unwatch(self)
        if self._cut:  # cut just as the answer came: the connection is gone all the same
            raise self._no_answer()
        return result

    def _no_answer(self) -> NoAnswer:
        return NoAnswer(
            f"no answer from the server within {self.reply_timeout:g} s "
            f"(OPTIONS['socket_timeout']); the connection was closed"
        )

    def cut(self) -> None:
        """Shut the socket down under libpq's wait (from the watchdog thread)."""
        self._cut = True
        try:
            fd = self.pgconn.socket
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, psycopg.Error):
            pass  # already closed: the wait has ended anyway


class _Pool:
    """A small LIFO pool of autocommit connections, connected in the caller's thread
    so that a connection failure surfaces at once, with its cause."""

    def __init__(
        self,
        kwargs: dict[str, Any],
        max_size: int,
        timeout: float,
        reply_timeout: float | None = None,
    ) -> None:
        self.kwargs = kwargs
        self.max_size = max_size
        self.timeout = timeout
        self.reply_timeout = reply_timeout
        self._idle: list[_Connection] = []
        self._count = 0
        self._cond = threading.Condition()

    def get(self, timeout: float | None = None) -> _Connection:
        """An idle connection, a new one, or one given back within ``timeout`` seconds
        (default: ``OPTIONS['pool_timeout']``); :class:`PoolExhausted` after that."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if not _ended_while_idle(conn):
                        return conn
                    self._count -= 1
                    conn.close()
                if self._count < self.max_size:
                    self._count += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolExhausted
                self._cond.wait(left)
        try:
            conn = _Connection.connect(**self.kwargs)
            conn.reply_timeout = self.reply_timeout
            return conn
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def put(self, conn: _Connection) -> None:
        with self._cond:
            if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                self._count -= 1
                if not conn.closed:
                    conn.close()
            else:
                self._idle.append(conn)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for conn in idle:
            conn.close()


class PoolExhausted(Exception):
    pass


def _ended_while_idle(conn: _Connection) -> bool:
    """Whether an idle pooled connection is closed, or was ended by the server (a
    DBA's pg_terminate_backend, ``idle_session_timeout``, a restart or failover).

    An idle connection of ours expects nothing from the server: anything to read on
    its socket (the server's last words, or the end of the stream) means it is gone,
    and it is replaced before a lock statement is sent on it. One poll, no round trip.
    """
    if conn.closed:
        return True
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)


_instances: weakref.WeakSet[PostgresBackend] = weakref.WeakSet()
# Connections inherited by a forked child: kept referenced and never closed there,
# since closing would end the parent's sessions (and its locks) on the server.
_inherited: list[Any] = []


# Django's own connections a forked child inherited (transaction mode runs on them),
# by id; the objects themselves are kept in _inherited, so an id is never reused.
_inherited_django: set[int] = set()


def _forget_connections_after_fork() -> None:
    try:
        for wrapper in connections.all(initialized_only=True):
            raw = wrapper.connection
            if raw is not None:
                _inherited.append(raw)
                _inherited_django.add(id(raw))
    except Exception:  # no settings in this process: no Django connection either
        pass
    for backend in list(_instances):
        _inherited.append((backend._pool, backend._held))
        backend._pool = None
        backend._held = {}
        backend._pool_lock = threading.Lock()
        backend._held_lock = threading.Lock()
    _watchdog.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections_after_fork)


@dataclass
class _Held:
    conn: _Connection
    key: int
    token: int
    #: "lock", or the permit kind (a permit is released only as that kind).
    kind: str = "lock"
    #: The statement that gives it back (parameters: key, reader).
    unlock: str = _UNLOCK
    #: A read lease's own registry row (0: none).
    reader: int = 0
    #: The name's guard key, taken (shared) by the statement that gives it back.
    guard: int = 0
    #: Transaction mode: the server's id of the transaction that holds it.
    transaction: str = ""


class PostgresBackend(BaseBackend):
    """Locks as PostgreSQL advisory locks, with a registry table for names and tokens."""

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "DATABASE"})
    option_keys: ClassVar[frozenset[str] | None] = frozenset(
        {
            "mode",
            "key_prefix",
            "pooler",
            "connect_timeout",
            "socket_timeout",
            "pool_timeout",
            "pool_size",
            "synchronous_commit",
            "application_name",
        }
    )
    wakes_on_release = True  # the server's lock queue does the waiting
    expires_on_server = False  # held until released or until the connection ends

    DEFAULT_POOL_SIZE = 20
    #: ``synchronous_commit`` of distlocks' own lock connections. "off": an acquire's
    #: registry write returns before its WAL is flushed to disk (it still is, within
    #: about three ``wal_writer_delay``, 0.6 s by default). A server crash can then lose
    #: the last counter updates, but never lets a token go back: the crash ends every
    #: session, and with it every lock, and the next token of a name is at least the
    #: server clock in microseconds, past every token minted before the crash (as long
    #: as that clock does not go back). The flush would otherwise cost more than the
    #: lock itself on a durable server.
    DEFAULT_SYNCHRONOUS_COMMIT = "off"
    SYNCHRONOUS_COMMIT_VALUES = ("on", "off", "local", "remote_write", "remote_apply")
    DEFAULT_CONNECT_TIMEOUT = 2
    #: Longest wait for the server's answer to one request (beyond a lock wait).
    DEFAULT_SOCKET_TIMEOUT = 5.0

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.database: str = config.get("DATABASE", "default")
        self.mode: str = self.options.get("mode", "session")
        self.key_prefix: str = self.options.get("key_prefix", conf.KEY_PREFIX)
        self._pool: _Pool | None = None
        self._pool_lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._held_lock = threading.Lock()
        # Permits pin a session like session-mode locks; a transaction ends them all.
        if self.mode == "session":
            self.permit_kinds = frozenset({SEMAPHORE, READ, WRITE})
        _instances.add(self)

    @property
    def ends_with_transaction(self) -> bool:
        """Transaction mode: a lock ends with the caller's transaction by itself, so a
        release inside ``atomic()`` needs no deferral (distlocks.transactions)."""
        return self.mode == "transaction"

    # -- configuration ----------------------------------------------------------

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        return problems + [message for _, message in cls._problems(alias, config)]

    @classmethod
    def _problems(cls, alias: str, config: Mapping[str, Any]) -> list[tuple[str, str]]:
        from django.conf import settings

        problems: list[tuple[str, str]] = []
        database = config.get("DATABASE", "default")
        databases = getattr(settings, "DATABASES", {})
        if database not in databases:
            problems.append(("E004", f"DATABASE {database!r} is not an alias in DATABASES"))
        elif not any(
            engine in str(databases[database].get("ENGINE", ""))
            for engine in ("postgresql", "postgis")
        ):
            problems.append(
                (
                    "E008",
                    f"DATABASE {database!r} uses {databases[database].get('ENGINE')!r}; "
                    f"PostgresBackend needs 'django.db.backends.postgresql'",
                )
            )
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            mode = options.get("mode", "session")
            if mode not in MODES:
                problems.append(
                    ("E004", f"OPTIONS['mode'] must be 'session' or 'transaction', not {mode!r}")
                )
            pooler = options.get("pooler")
            if pooler not in (None, "session", "transaction"):
                problems.append(
                    (
                        "E004",
                        f"OPTIONS['pooler'] must be None, 'session' or 'transaction', "
                        f"not {pooler!r}",
                    )
                )
            if mode == "session" and pooler == "transaction":
                problems.append(
                    (
                        "E009",
                        "session-mode advisory locks do not work behind a transaction-pooling "
                        "proxy (the lock stays on a server connection other clients reuse); "
                        "use OPTIONS['mode'] = 'transaction' or connect past the pooler",
                    )
                )
            for key in ("socket_timeout", "connect_timeout", "pool_timeout"):
                value = options.get(key, 1)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    problems.append(
                        ("E004", f"OPTIONS[{key!r}] must be a number of seconds > 0, not {value!r}")
                    )
            synchronous = options.get("synchronous_commit", cls.DEFAULT_SYNCHRONOUS_COMMIT)
            if synchronous is not None and synchronous not in cls.SYNCHRONOUS_COMMIT_VALUES:
                problems.append(
                    (
                        "E004",
                        f"OPTIONS['synchronous_commit'] must be None (the server's setting) or "
                        f"one of {', '.join(map(repr, cls.SYNCHRONOUS_COMMIT_VALUES))}, "
                        f"not {synchronous!r}",
                    )
                )
            size = options.get("pool_size", cls.DEFAULT_POOL_SIZE)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                problems.append(("E004", f"OPTIONS['pool_size'] must be an int >= 1, not {size!r}"))
        return problems

    @classmethod
    def check_config(cls, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        """System-check messages, with the dedicated IDs E008 and E009."""
        texts = {
            "E004": "A DISTLOCKS_BACKENDS entry is not valid for its backend class.",
            "E008": "PostgresBackend needs a PostgreSQL database.",
            "E009": "Session-mode PostgreSQL locks cannot work behind transaction pooling.",
        }
        problems = [("E004", p) for p in super().validate_config(alias, config)]
        return [
            Error(texts[check_id], hint=f"DISTLOCKS_BACKENDS[{alias!r}]: {problem}.",
                  id=f"distlocks.{check_id}")
            for check_id, problem in problems + cls._problems(alias, config)
        ]  # fmt: skip

    def _connect_kwargs(self) -> dict[str, Any]:
        wrapper = connections[self.database]
        try:
            params = dict(wrapper.get_connection_params())
        except ImproperlyConfigured as exc:
            # Django quotes the setting it refuses (a NAME may be a URL with a password).
            redact_exception(exc)
            raise
        # Django's own cursor classes and adapters are not needed on these connections.
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.setdefault(
            "connect_timeout", self.options.get("connect_timeout", self.DEFAULT_CONNECT_TIMEOUT)
        )
        params["application_name"] = self.options.get("application_name", "distlocks")
        # Detect a dead peer in seconds rather than the kernel's default hours.
        params.setdefault("keepalives", 1)
        params.setdefault("keepalives_idle", 2)
        params.setdefault("keepalives_interval", 1)
        params.setdefault("keepalives_count", 2)
        params.setdefault("tcp_user_timeout", 3000)
        # A statement_timeout from DATABASES would cut lock waits short: these
        # connections bound their waits with lock_timeout instead.
        options = f"{params.get('options', '')} -c statement_timeout=0"
        # The registry write of each acquire need not wait for its WAL flush: see
        # DEFAULT_SYNCHRONOUS_COMMIT. None keeps the server's (or DATABASES') setting.
        synchronous = self.options.get("synchronous_commit", self.DEFAULT_SYNCHRONOUS_COMMIT)
        if synchronous is not None:
            options += f" -c synchronous_commit={synchronous}"
        params["options"] = options.strip()
        params["autocommit"] = True
        # Django turns server-side preparation off (for transaction poolers); these
        # connections are ours and session-bound, and parsing and planning the
        # acquire statement on every call costs more than the lock itself.
        params["prepare_threshold"] = 2
        return params

    @property
    def pool(self) -> _Pool:
        """The pool of lock connections, apart from Django's (created on first use)."""
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = _Pool(
                        self._connect_kwargs(),
                        max_size=self.options.get("pool_size", self.DEFAULT_POOL_SIZE),
                        timeout=self.options.get("pool_timeout", 5.0),
                        reply_timeout=self.options.get(
                            "socket_timeout", self.DEFAULT_SOCKET_TIMEOUT
                        ),
                    )
        return self._pool

    def close(self) -> None:
        """Close every connection, which also frees the locks still held on them."""
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        for entry in held:
            if self.mode == "session":
                entry.conn.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- helpers ----------------------------------------------------------------

    def key(self, name: str) -> int:
        return lock_key(self.key_prefix, name)

    def _unavailable(self, action: str, name: str, exc: Exception) -> LockBackendUnavailable:
        err = LockBackendUnavailable(
            self.alias, f"{action} {name!r} failed: {type(exc).__name__}: {exc}"
        )
        err.__cause__ = exc
        return err

    def _driver_error(self, action: str, name: str, exc: BaseException) -> LockError:
        cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.Error) else exc
        hint = ""
        if isinstance(cause, psycopg.errors.UndefinedTable):
            hint = (
                f" The {TABLE} table is missing: run `manage.py migrate distlocks"
                f" --database {self.database}`."
            )
        elif isinstance(cause, psycopg.errors.InsufficientPrivilege):
            hint = (
                " The database role lacks a privilege (pg_terminate_backend needs the same"
                " role as the holder, membership of pg_signal_backend, or superuser)."
            )
        return LockError(
            f"PostgreSQL error while trying to {action} lock {name!r} on backend "
            f"{self.alias!r}: {type(cause).__name__}: {cause}".rstrip()
            + hint
        )

    @contextlib.contextmanager
    def _mapped_errors(self, action: str, name: str) -> Iterator[None]:
        """Driver errors as distlocks errors: an outage, or a LockError with a hint."""
        try:
            yield
        except psycopg.OperationalError as exc:
            raise self._unavailable(action, name, exc) from exc
        except psycopg.Error as exc:
            raise self._driver_error(action, name, exc) from exc

    @contextlib.contextmanager
    def _pooled(self, action: str, name: str) -> Iterator[_Connection]:
        """A pooled connection for a short statement (inspection, force release):
        back to the pool afterwards, closed if anything went wrong."""
        conn = self._checkout(name)
        try:
            with self._mapped_errors(action, name):
                yield conn
        except BaseException:
            self._discard(conn)
            raise
        self.pool.put(conn)

    def _checkout(self, name: str, wait: float | None = None) -> _Connection:
        """A pooled connection; a caller that may wait for its lock (``wait`` > 0)
        waits for a connection within that same budget."""
        timeout = wait if wait is not None and wait > 0 else None
        try:
            return self.pool.get(timeout)
        except PoolExhausted as exc:
            waited = self.pool.timeout if timeout is None else timeout
            raise LockError(
                f"No connection for lock {name!r} on backend {self.alias!r} within "
                f"{waited:g} s: all {self.pool.max_size} pooled connections are in use "
                f"(each held lock pins one, and so does each caller waiting in the server's "
                f"queue). Raise OPTIONS['pool_size'] (within the server's max_connections) "
                f"to at least the number of locks this process holds and waits for at once."
            ) from exc
        except psycopg.OperationalError as exc:
            raise self._unavailable("connect for", name, exc) from exc

    def _discard(self, conn: _Connection) -> None:
        """Close a connection whose state is unknown; the server frees its locks."""
        try:
            conn.close()
        finally:
            self.pool.put(conn)

    def _params(self, name: str, owner: str, ttl: float, holder: Holder) -> dict[str, Any]:
        return {
            "key": self.key(name),
            "name": name,
            "owner": owner,
            "host": holder.host[:255],
            "pid": holder.pid,
            "thread": holder.thread[:255],
            "ttl": ttl,
            "extra": json.dumps(dict(holder.extra)) if holder.extra else "{}",
        }

    # -- the contract -----------------------------------------------------------

    def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        if self.mode == "transaction":
            return self._acquire_xact(name, owner, ttl, holder, wait)
        with self._held_lock:
            again = self._held.get(owner)
        if again is not None:  # a retried acquire by the same owner
            return AcquireResult(True, again.token, ttl)
        params = self._params(name, owner, ttl, holder)
        deadline = time.monotonic() + wait
        conn = self._checkout(name, wait)
        ours = True  # conn is checked out (to put back or discard)
        try:
            with self._mapped_errors("acquire", name):
                try:
                    token = self._lock_statement(conn, params, deadline, wait)
                except psycopg.OperationalError as exc:
                    if isinstance(exc, NoAnswer):
                        raise
                    # The connection died under the statement (ended by the server
                    # just before): any lock it took ended with it, so one more try
                    # on a new connection is safe.
                    ours = False
                    self._discard(conn)
                    conn = self._checkout(name, max(0.0, deadline - time.monotonic()))
                    ours = True
                    token = self._lock_statement(conn, params, deadline, wait)
        except BaseException:
            # Whatever happened, this connection must not keep a lock nobody owns.
            if ours:
                self._discard(conn)
            raise
        if token is None:
            self.pool.put(conn)
            return AcquireResult(False, 0, None)
        with self._held_lock:
            self._held[owner] = _Held(conn, params["key"], token, guard=self._guard(name))
        # The lease is confirmed by renewal pings; locally valid for one ttl.
        return AcquireResult(True, token, ttl)

    def _lock_statement(
        self, conn: _Connection, params: dict[str, Any], deadline: float, wait: float
    ) -> int | None:
        """Run the acquire statement: a wait in the server's queue for the rest of the
        caller's budget, or one try. The token, or None when not granted."""
        if wait > 0:
            left = deadline - time.monotonic()
            if left > 0:
                return self._acquire_blocking(conn, params, left)
        row = conn.execute(_ACQUIRE_TRY, params).fetchone()
        return None if row is None else int(row[0])

    def _acquire_blocking(
        self,
        conn: _Connection,
        params: dict[str, Any],
        wait: float,
        statement: str = _ACQUIRE.format(lock=WAIT),
    ) -> int | None:
        """Wait in the server's queue for up to ``wait`` seconds (one round trip)."""
        wait = min(wait, 3600.0)
        timeout_ms = max(1, round(wait * 1000))
        try:
            conn.lock_wait = wait  # the server answers only when the wait is over
            try:
                # Never prepared: a statement psycopg prepares inside a pipeline that
                # then fails (the lock timeout) is remembered as prepared although the
                # server dropped it, and the next use failed with "prepared statement
                # _pg3_1 does not exist". A wait costs far more than planning anyway.
                with conn.pipeline():
                    conn.execute(f"SET lock_timeout = {timeout_ms}", prepare=False)
                    cur = conn.execute(statement, params, prepare=False)
                    conn.execute("SET lock_timeout = 0", prepare=False)
            finally:
                conn.lock_wait = 0.0
            row = cur.fetchone()
            return None if row is None else int(row[0])
        except psycopg.errors.LockNotAvailable:
            # The timeout may fire at the very moment the lock is granted; the
            # statement then fails but the session lock stays. Drop anything held.
            conn.execute("SELECT pg_advisory_unlock_all()")
            conn.execute("SET lock_timeout = 0")
            return None

    def release(self, name: str, owner: str) -> bool:
        if self.mode == "transaction":
            return self._release_xact(name, owner)
        with self._held_lock:
            held = self._held.pop(owner, None)
        if held is None:
            return False
        return self._give_back(held)

    def _give_back(self, held: _Held) -> bool:
        """Unlock on the lease's own connection, then return it to the pool."""
        try:
            params = {"key": held.key, "reader": held.reader, "guard": held.guard}
            row = held.conn.execute(held.unlock, params).fetchone()
        except psycopg.Error:
            # The connection is gone, and the server freed the lock with it.
            self._discard(held.conn)
            return False
        self.pool.put(held.conn)
        return bool(row and row[0])

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Confirm the lease: its connection is alive and still holds the lock."""
        if self.mode == "transaction":
            return self._xact_held(owner)
        with self._held_lock:
            held = self._held.get(owner)
        if held is None:
            return False
        classid, objid = key_parts(held.key)
        try:
            row = held.conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()"
                " AND locktype = 'advisory' AND classid = %s AND objid = %s"
                " AND objsubid = 1 AND granted)",
                (classid, objid),
            ).fetchone()
        except psycopg.Error:
            # Terminated or cut off: a session lock does not outlive its connection.
            with self._held_lock:
                self._held.pop(owner, None)
            self._discard(held.conn)
            return False
        return bool(row and row[0])

    def force_release(self, name: str, token: int | None = None) -> bool:
        key = self.key(name)
        classid, objid = key_parts(key)
        params = {"key": key, "classid": classid, "objid": objid, "token": token}
        if self.mode == "transaction":
            with self._pooled("force-release", name) as conn:
                conn.lock_wait = 5.0  # the statement waits for the session to end
                try:
                    row = conn.execute(_FORCE_RELEASE_XACT, params).fetchone()
                finally:
                    conn.lock_wait = 0.0
            return bool(row and row[0])

        def evict(conn: _Connection) -> bool:
            row = conn.execute(
                f"SELECT fencing_token, backend_pid FROM {TABLE} WHERE key = %(key)s FOR UPDATE",
                params,
            ).fetchone()
            holder = conn.execute(_HOLDER, params).fetchone()
            if holder is None:
                return False  # free: nothing is written
            if token is not None and (row is None or (int(row[0]), row[1]) != (token, holder[0])):
                return False  # another holder than the one shown: left alone
            conn.execute(_BUMP, params)
            ended = conn.execute(_TERMINATE, {"pids": [holder[0]]}).fetchone()
            return bool(ended and ended[0])

        return self._guarded("force-release", name, evict)

    def _guard(self, name: str) -> int:
        """The advisory key that serializes giving back ``name`` (a lock, or any permit
        of a semaphore or read-write lock of that name) with its force release."""
        return self._derived_key(name, "guard")

    def _guarded(self, action: str, name: str, evict: Any) -> Any:
        """Run ``evict(conn)`` in one transaction holding ``name``'s guard exclusively:
        no holder of ``name`` can give its lock back (and reuse its session for another
        lease) between the check of who holds it and the end of that session."""
        with self._pooled(action, name) as conn:
            conn.lock_wait = 10.0  # waits for the guard, then for the session to end
            try:
                with conn.transaction():
                    # A row locked by an open transaction (a transaction-mode holder of
                    # the same name) must not hold the caller forever.
                    conn.execute("SET LOCAL lock_timeout = 5000")
                    conn.execute(
                        "SELECT pg_advisory_xact_lock(%(guard)s)", {"guard": self._guard(name)}
                    )
                    return evict(conn)
            except psycopg.errors.LockNotAvailable as exc:
                raise LockError(
                    f"Could not {action} {name!r} on backend {self.alias!r}: another force "
                    f"release of it, or an open transaction holding its registry row (a "
                    f"transaction-mode holder of the same name?), kept it locked for 5 s. "
                    f"Try again once that has ended."
                ) from exc
            finally:
                conn.lock_wait = 0.0

    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none)."""
        with connections[self.database].cursor() as cursor:
            cursor.execute(f"SELECT fencing_token FROM {TABLE} WHERE key = %s", [self.key(name)])
            row = cursor.fetchone()
        return int(row[0]) if row else 0

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        """Nothing to do: :meth:`acquire` already waited in the server's queue."""

    # -- inspection -------------------------------------------------------------

    def _rows(self, where: str = "", params: tuple[Any, ...] = ()) -> list[LockInfo]:
        query = _LOCKS + where + " ORDER BY acquired_at"
        with self._pooled("list", where or "locks") as conn:
            cur = conn.execute(query, params)
            columns = [c.name for c in cur.description or ()]
            rows = [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]
        return [self._info(row) for row in rows]

    def _info(self, row: Mapping[str, Any]) -> LockInfo:
        acquired = row["acquired_at"]
        if acquired is not None and acquired.tzinfo is None:
            acquired = acquired.replace(tzinfo=dt.UTC)
        return LockInfo(
            name=row["name"],
            backend=self.alias,
            owner=row["owner"],
            fencing_token=int(row["fencing_token"]),
            host=row["host"],
            pid=row["pid"],
            thread=row["thread"],
            acquired_at=acquired,
            expires_at=None,
            ttl=row["ttl"],
            renewals=row["renewals"],
            waiters=int(row["waiters"]),
            extra={
                # "of" only ties a permit's row to its semaphore or read-write lock.
                **{k: v for k, v in holder_details(row["extra"]).items() if k != "of"},
                "backend_pid": row["backend_pid"],
                "application_name": row["application_name"],
                "client_addr": row["client_addr"],
                "session_state": row["state"],
                # A session-mode lease pings its connection at every renewal: an idle
                # session quiet for longer than the ttl has a holder that stopped.
                "last_activity": row["state_change"],
            },
        )

    def inspect(self, name: str) -> LockInfo | None:
        rows = self._rows(" AND lkey = %s AND mode = 'ExclusiveLock'", (self.key(name),))
        return rows[0] if rows else None

    # The listing's own query: the columns of _LOCKS that a LockInfo needs, the holder
    # details as JSON text (parsed only when there are some), rows as plain tuples.
    _LISTING = f"""
    SELECT name, owner, fencing_token, host, pid, thread, acquired_at, ttl, renewals,
           extra::text, backend_pid, application_name, client_addr, state, state_change,
           waiters
    FROM ({_LOCKS}) AS listed
    """

    def iter_locks(self) -> Iterator[LockInfo]:
        """Every live lock, semaphore permit and read-write lease, in one query: with
        many locks, most of the time goes to turning rows into objects, so this does as
        little per row as it can."""
        with self._pooled("list", "locks") as conn:
            rows = conn.execute(self._LISTING).fetchall()
        alias, utc = self.alias, dt.UTC
        for (name, owner, token, host, pid, thread, acquired, ttl, renewals, extra,
             backend_pid, application, address, state, changed, waiters) in rows:  # fmt: skip
            details = holder_details(extra)
            # "of" only ties a permit's row to its semaphore or read-write lock.
            details.pop("of", None)
            details["backend_pid"] = backend_pid
            details["application_name"] = application
            details["client_addr"] = address
            details["session_state"] = state
            # A session-mode lease pings its connection at every renewal: an idle
            # session quiet for longer than the ttl has a holder that stopped.
            details["last_activity"] = changed
            if acquired is not None and acquired.tzinfo is None:
                acquired = acquired.replace(tzinfo=utc)
            yield LockInfo(
                name=name,
                backend=alias,
                owner=owner,
                fencing_token=int(token),
                host=host,
                pid=pid,
                thread=thread,
                acquired_at=acquired,
                expires_at=None,
                ttl=ttl,
                renewals=renewals,
                waiters=int(waiters),
                extra=details,
            )

    # -- semaphores and read-write locks (session mode) ---------------------------

    def _derived_key(self, name: str, *parts: str) -> int:
        # Names have no control characters: these never collide with a lock's key.
        return lock_key(self.key_prefix, "\x00".join((name, *parts)))

    def _of(self, kind: str, name: str) -> int:
        """The key that identifies the semaphore or read-write lock ``name``; for a
        read-write lock it is also the advisory lock, and its row keeps the counter."""
        return self._derived_key(name, permit_family(kind))

    def permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        limit: int = 1,
        wait: float = 0.0,
    ) -> AcquireResult:
        self.check_permit_kind(kind)
        with self._held_lock:
            again = self._held.get(owner)
        if again is not None:  # a retried acquire by the same owner
            return AcquireResult(True, again.token, ttl)
        of = self._of(kind, name)
        params = self._params(name, owner, ttl, holder)
        extra: dict[str, Any] = {**holder.extra, "kind": kind, "of": str(of)}
        reader, unlock = 0, _UNLOCK
        if kind == SEMAPHORE:
            extra["limit"] = limit
            keys = _slot_keys(self.key_prefix, name, limit)
            params.update(keys=keys, limit=limit)
            statement, waits = _SEM_ACQUIRE, False
        elif kind == WRITE:
            statement = _WRITE_ACQUIRE.format(lock=WAIT if wait > 0 else TRY)
            waits = wait > 0
        else:
            reader, unlock = self._derived_key(name, "rwlock", owner), _READ_UNLOCK
            params["reader"] = reader
            statement = _READ_ACQUIRE.format(lock=WAIT_SHARED if wait > 0 else TRY_SHARED)
            waits = wait > 0
        params.update(key=of, of=str(of), extra=json.dumps(extra))
        deadline = time.monotonic() + wait
        conn = self._checkout(name, wait if waits else None)
        try:
            with self._mapped_errors("acquire", name):
                if waits:
                    left = max(0.001, deadline - time.monotonic())
                    got = self._acquire_blocking(conn, params, left, statement)
                else:
                    row = conn.execute(statement, params).fetchone()
                    got = None if row is None else int(row[0])
        except BaseException:
            # Whatever happened, this connection must not keep a lock nobody owns.
            self._discard(conn)
            raise
        if got is None:
            self.pool.put(conn)
            return AcquireResult(False, 0, None)
        # A semaphore permit holds the slot it took; a write lease gets its token.
        key, token = (got, 0) if kind == SEMAPHORE else (of, got)
        held = _Held(
            conn, key, token, kind=kind, unlock=unlock, reader=reader, guard=self._guard(name)
        )
        with self._held_lock:
            self._held[owner] = held
        return AcquireResult(True, held.token, ttl)

    def _own_permit(self, kind: str, owner: str) -> bool:
        self.check_permit_kind(kind)
        with self._held_lock:
            held = self._held.get(owner)
        return held is not None and held.kind == kind

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        return self._own_permit(kind, owner) and self.release(name, owner)

    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        return self._own_permit(kind, owner) and self.extend(name, owner, ttl)

    def permit_wakes_on_release(self, kind: str) -> bool:
        # Readers and writers wait in the server's queue; a semaphore has no one lock
        # to queue on, so its waiters poll (with a growing interval, up to 0.1 s).
        return kind != SEMAPHORE

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        if kind == SEMAPHORE:
            time.sleep(max(0.0, timeout))

    async def apermit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        if kind == SEMAPHORE:
            await asyncio.sleep(max(0.0, timeout))

    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        self.check_permit_kind(kind)
        return self._rows(" AND extra->>'of' = %s", (str(self._of(kind, name)),))

    def iter_permits(self) -> Iterator[LockInfo]:
        yield from self._rows(" AND extra->>'of' IS NOT NULL")

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        self.check_permit_kind(kind)
        of = self._of(kind, name)

        def evict(conn: _Connection) -> int:
            rows = conn.execute(_PERMIT_TARGETS, {"of": str(of), "owner": owner}).fetchall()
            if not rows:
                return 0  # no such holder: nothing is written
            if permit_family(kind) != SEMAPHORE:
                # The write counter moves on, so an evicted writer's writes are refused.
                conn.execute(_BUMP, {"key": of})
            ended = conn.execute(_TERMINATE, {"pids": [row[0] for row in rows]}).fetchone()
            return int(ended[0]) if ended else 0

        return int(self._guarded("force-release", name, evict))

    def permit_counter(self, name: str) -> int:
        self.check_permit_kind(WRITE)
        with self._pooled("read the write counter of", name) as conn:
            row = conn.execute(
                f"SELECT fencing_token FROM {TABLE} WHERE key = %s", (self._of(WRITE, name),)
            ).fetchone()
        return int(row[0]) if row else 0

    # -- transaction mode -------------------------------------------------------

    def _django_connection(self, name: str) -> Any:
        conn = connections[self.database]
        if _inherited_django and id(conn.connection) in _inherited_django:
            # The fork rule: the parent's session (and open transaction, where its own
            # transaction-mode locks live) is not this process's to lock in.
            raise LockError(
                f"Lock {name!r} uses backend {self.alias!r} in transaction mode on the "
                f"database connection {self.database!r}, which this process inherited "
                f"when it was forked: its statements would run in the parent's session "
                f"and transaction, where the parent's locks are already held. Give the "
                f"child connections of its own (Celery's prefork workers do this; "
                f"closing the inherited connection with close() would end the parent's "
                f"session)."
            )
        if not conn.in_atomic_block:
            raise LockError(
                f"Lock {name!r} uses backend {self.alias!r} in transaction mode, which "
                f"must be taken inside transaction.atomic(using={self.database!r}); the lock "
                f"is released at COMMIT or ROLLBACK."
            )
        return conn

    def _acquire_xact(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float
    ) -> AcquireResult:
        from django.db import DatabaseError

        try:
            return self._acquire_xact_inner(name, owner, ttl, holder, wait)
        except DatabaseError as exc:
            raise self._driver_error("acquire", name, exc) from exc

    def _acquire_xact_inner(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float
    ) -> AcquireResult:
        conn = self._django_connection(name)
        self._prune_xact()
        params = self._params(name, owner, ttl, holder)
        with conn.cursor() as cursor:
            if wait <= 0:
                cursor.execute(TRY_XACT, params)
                granted = bool(cursor.fetchone()[0])
            else:
                # A savepoint bounds the wait: on timeout only the savepoint rolls
                # back, and SET LOCAL does not leak into the caller's transaction.
                timeout_ms = max(1, round(min(wait, 3600.0) * 1000))
                cursor.execute("SAVEPOINT distlocks_wait")
                cursor.execute("SELECT current_setting('lock_timeout')")
                previous = cursor.fetchone()[0]
                cursor.execute(f"SET LOCAL lock_timeout = {timeout_ms}")
                try:
                    cursor.execute(WAIT_XACT, params)
                    granted = cursor.fetchone() is not None
                except Exception as exc:
                    cursor.execute("ROLLBACK TO SAVEPOINT distlocks_wait")
                    if getattr(exc, "__cause__", None) is not None and isinstance(
                        exc.__cause__, psycopg.errors.LockNotAvailable
                    ):
                        return AcquireResult(False, 0, None)
                    raise
                finally:
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
                    cursor.execute("RELEASE SAVEPOINT distlocks_wait")
        if not granted:
            return AcquireResult(False, 0, None)
        # The token and the holder are written on a connection of our own, committed at
        # once: written in the caller's transaction they would stay invisible to
        # everyone else (the listing, a force release) until it commits. The lock is
        # already held, so no one else can mint a token for this name meanwhile.
        params["backend_pid"] = conn.connection.info.backend_pid
        with self._pooled("acquire", name) as registry:
            row = registry.execute(_REGISTER_XACT, params).fetchone()
        token = int(row[0]) if row else 0
        with self._held_lock:
            self._held[owner] = _Held(
                conn.connection, params["key"], token, transaction=self._transaction_id(conn)
            )
        # Forget it when the transaction commits (a rollback is caught by _prune_xact).
        transaction.on_commit(lambda: self._forget(owner), using=self.database)
        return AcquireResult(True, token, None)

    @staticmethod
    def _transaction_id(conn: Any) -> str:
        """The server's id of the connection's current transaction (its virtual
        transaction id: every transaction has one, even before it writes)."""
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT virtualtransaction FROM pg_locks WHERE pid = pg_backend_pid()"
                " AND locktype = 'virtualxid' LIMIT 1"
            )
            row = cursor.fetchone()
        return str(row[0]) if row else ""

    def lease_ended(self, name: str, owner: str) -> bool:
        """Transaction mode: the lease's transaction has ended (committed or rolled
        back; a later transaction on the same connection is another one)."""
        if self.mode != "transaction":
            return False
        with self._held_lock:
            held = self._held.get(owner)
        if held is None:
            return True
        conn = connections[self.database]
        if not (conn.in_atomic_block and conn.connection is held.conn):
            return True
        return self._transaction_id(conn) != held.transaction

    def _forget(self, owner: str) -> None:
        with self._held_lock:
            self._held.pop(owner, None)

    def _prune_xact(self) -> None:
        """Drop entries of transactions that ended (this thread's connection only)."""
        conn = connections[self.database]
        with self._held_lock:
            for owner, held in list(self._held.items()):
                if held.conn is conn.connection and not conn.in_atomic_block:
                    del self._held[owner]

    def _xact_held(self, owner: str) -> bool:
        """Still held: same transaction, and (a rolled-back savepoint frees it) still
        listed in pg_locks for this session."""
        with self._held_lock:
            held = self._held.get(owner)
        if held is None:
            return False
        conn = connections[self.database]
        if not (conn.in_atomic_block and conn.connection is held.conn):
            return False
        classid, objid = key_parts(held.key)
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()"
                " AND locktype = 'advisory' AND classid = %s AND objid = %s"
                " AND objsubid = 1 AND granted)",
                [classid, objid],
            )
            return bool(cursor.fetchone()[0])

    def _release_xact(self, name: str, owner: str) -> bool:
        # A transaction-level lock cannot be released early: it ends with the
        # transaction. Forget it here; report whether it was still ours.
        held = self._xact_held(owner)
        with self._held_lock:
            self._held.pop(owner, None)
        return held

    def held_connection_count(self) -> int:
        """Connections currently pinned to leases (for tests and metrics)."""
        with self._held_lock:
            return len(self._held)
