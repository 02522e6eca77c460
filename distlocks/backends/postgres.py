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

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
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

from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockError

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

# Live advisory locks of this database, joined with the registry and the holder's
# session. classid/objid are the high/low 32 bits of the bigint key.
_LOCKS = f"""
SELECT r.name, r.owner, r.fencing_token, r.host, r.pid, r.thread, r.acquired_at, r.ttl,
       r.renewals, r.extra, l.pid AS backend_pid, a.application_name,
       host(a.client_addr) AS client_addr, a.state,
       (SELECT count(*) FROM pg_locks w
         WHERE w.locktype = 'advisory' AND w.database = l.database
           AND w.classid = l.classid AND w.objid = l.objid AND w.objsubid = 1
           AND NOT w.granted) AS waiters
FROM pg_locks l
JOIN {TABLE} r ON r.key = ((l.classid::bigint << 32) | l.objid::bigint)
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

TRY = "SELECT pg_try_advisory_lock(%(key)s) AS ok"
WAIT = "SELECT true AS ok FROM (SELECT pg_advisory_lock(%(key)s)) AS waited"
TRY_XACT = "SELECT pg_try_advisory_xact_lock(%(key)s) AS ok"
WAIT_XACT = "SELECT true AS ok FROM (SELECT pg_advisory_xact_lock(%(key)s)) AS waited"

_FORCE_RELEASE = f"""
WITH holder AS MATERIALIZED (
    SELECT l.pid FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = %(classid)s AND l.objid = %(objid)s
), killed AS MATERIALIZED (
    SELECT pg_terminate_backend(pid) AS ok FROM holder
), bumped AS (
    UPDATE {TABLE} SET fencing_token = greatest(fencing_token + 1, {_CLOCK_US})
    WHERE key = %(key)s RETURNING 1
)
SELECT coalesce(bool_or(ok), false) FROM killed
"""


def lock_key(prefix: str, name: str) -> int:
    """The signed 64-bit advisory-lock key of ``name`` under ``prefix`` (SHA-256)."""
    digest = hashlib.sha256(f"{prefix}\x00{name}".encode()).digest()
    return int(struct.unpack(">q", digest[:8])[0])


def key_parts(key: int) -> tuple[int, int]:
    """``(classid, objid)`` as ``pg_locks`` shows a bigint key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


class _Pool:
    """A small LIFO pool of autocommit connections, connected in the caller's thread
    so that a connection failure surfaces at once, with its cause."""

    def __init__(self, kwargs: dict[str, Any], max_size: int, timeout: float) -> None:
        self.kwargs = kwargs
        self.max_size = max_size
        self.timeout = timeout
        self._idle: list[psycopg.Connection[Any]] = []
        self._count = 0
        self._cond = threading.Condition()

    def get(self) -> psycopg.Connection[Any]:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.closed:
                        return conn
                    self._count -= 1
                if self._count < self.max_size:
                    self._count += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolExhausted
                self._cond.wait(left)
        try:
            return psycopg.connect(**self.kwargs)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def put(self, conn: psycopg.Connection[Any]) -> None:
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


_instances: weakref.WeakSet[PostgresBackend] = weakref.WeakSet()
# Connections inherited by a forked child: kept referenced and never closed there,
# since closing would end the parent's sessions (and its locks) on the server.
_inherited: list[Any] = []


def _forget_connections_after_fork() -> None:
    for backend in list(_instances):
        _inherited.append((backend._pool, backend._held))
        backend._pool = None
        backend._held = {}
        backend._pool_lock = threading.Lock()
        backend._held_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections_after_fork)


@dataclass
class _Held:
    conn: psycopg.Connection[Any]
    key: int
    token: int


class PostgresBackend(BaseBackend):
    """Locks as PostgreSQL advisory locks, with a registry table for names and tokens."""

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "DATABASE"})
    wakes_on_release = True  # the server's lock queue does the waiting
    expires_on_server = False  # held until released or until the connection ends

    DEFAULT_POOL_SIZE = 20
    DEFAULT_CONNECT_TIMEOUT = 2

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.database: str = config.get("DATABASE", "default")
        self.mode: str = self.options.get("mode", "session")
        self.key_prefix: str = self.options.get("key_prefix", conf.KEY_PREFIX)
        self._pool: _Pool | None = None
        self._pool_lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._held_lock = threading.Lock()
        _instances.add(self)

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
        params = dict(wrapper.get_connection_params())
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
        params["options"] = f"{params.get('options', '')} -c statement_timeout=0".strip()
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
    def _pooled(self, action: str, name: str) -> Iterator[psycopg.Connection[Any]]:
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

    def _checkout(self, name: str) -> psycopg.Connection[Any]:
        try:
            return self.pool.get()
        except PoolExhausted as exc:
            raise LockError(
                f"No connection for lock {name!r} on backend {self.alias!r}: all "
                f"{self.pool.max_size} pooled connections are pinned to held locks. Raise "
                f"OPTIONS['pool_size'] if this process holds that many locks at once."
            ) from exc
        except psycopg.OperationalError as exc:
            raise self._unavailable("connect for", name, exc) from exc

    def _discard(self, conn: psycopg.Connection[Any]) -> None:
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
        conn = self._checkout(name)
        try:
            with self._mapped_errors("acquire", name):
                if wait > 0:
                    token = self._acquire_blocking(conn, params, wait)
                else:
                    row = conn.execute(_ACQUIRE.format(lock=TRY), params).fetchone()
                    token = None if row is None else int(row[0])
        except BaseException:
            # Whatever happened, this connection must not keep a lock nobody owns.
            self._discard(conn)
            raise
        if token is None:
            self.pool.put(conn)
            return AcquireResult(False, 0, None)
        with self._held_lock:
            self._held[owner] = _Held(conn, params["key"], token)
        # The lease is confirmed by renewal pings; locally valid for one ttl.
        return AcquireResult(True, token, ttl)

    def _acquire_blocking(
        self, conn: psycopg.Connection[Any], params: dict[str, Any], wait: float
    ) -> int | None:
        """Wait in the server's queue for up to ``wait`` seconds (one round trip)."""
        timeout_ms = max(1, round(min(wait, 3600.0) * 1000))
        try:
            with conn.pipeline():
                conn.execute(f"SET lock_timeout = {timeout_ms}")
                cur = conn.execute(_ACQUIRE.format(lock=WAIT), params)
                conn.execute("SET lock_timeout = 0")
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
        try:
            row = held.conn.execute("SELECT pg_advisory_unlock(%s)", (held.key,)).fetchone()
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

    def force_release(self, name: str) -> bool:
        key = self.key(name)
        classid, objid = key_parts(key)
        with self._pooled("force-release", name) as conn:
            row = conn.execute(
                _FORCE_RELEASE, {"key": key, "classid": classid, "objid": objid}
            ).fetchone()
        return bool(row and row[0])

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
        query = _LOCKS + where + " ORDER BY r.acquired_at"
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
                **(row["extra"] or {}),
                "backend_pid": row["backend_pid"],
                "application_name": row["application_name"],
                "client_addr": row["client_addr"],
                "session_state": row["state"],
            },
        )

    def inspect(self, name: str) -> LockInfo | None:
        classid, objid = key_parts(self.key(name))
        rows = self._rows(" AND l.classid = %s AND l.objid = %s", (classid, objid))
        return rows[0] if rows else None

    def iter_locks(self) -> Iterator[LockInfo]:
        yield from self._rows()

    # -- transaction mode -------------------------------------------------------

    def _django_connection(self, name: str) -> Any:
        conn = connections[self.database]
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
                cursor.execute(_ACQUIRE.format(lock=TRY_XACT), params)
                row = cursor.fetchone()
            else:
                # A savepoint bounds the wait: on timeout only the savepoint rolls
                # back, and SET LOCAL does not leak into the caller's transaction.
                timeout_ms = max(1, round(min(wait, 3600.0) * 1000))
                cursor.execute("SAVEPOINT distlocks_wait")
                cursor.execute("SELECT current_setting('lock_timeout')")
                previous = cursor.fetchone()[0]
                cursor.execute(f"SET LOCAL lock_timeout = {timeout_ms}")
                try:
                    cursor.execute(_ACQUIRE.format(lock=WAIT_XACT), params)
                    row = cursor.fetchone()
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
        if row is None:
            return AcquireResult(False, 0, None)
        with self._held_lock:
            self._held[owner] = _Held(conn.connection, params["key"], int(row[0]))
        # Forget it when the transaction commits (a rollback is caught by _prune_xact).
        transaction.on_commit(lambda: self._forget(owner), using=self.database)
        return AcquireResult(True, int(row[0]), None)

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
