"""What every recipe of the PostgreSQL backend stands on: its lock connections
(checked out of :mod:`.pool`, given back or discarded), the leases this process
holds on them, the keys it derives from a name, the wait in the server's lock queue
(locks and permits both queue there), the name's guard that a force release holds,
and driver errors mapped to distlocks' own (an outage is
:class:`LockBackendUnavailable`, anything else a :class:`LockError` saying what to
change).
"""

from __future__ import annotations

import contextlib
import errno
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
from django.apps import apps

from distlocks.backends import capabilities
from distlocks.backends.base import BaseBackend, Holder
from distlocks.backends.postgres import configuration, sql, wire
from distlocks.backends.postgres.keys import lock_key
from distlocks.backends.postgres.pool import Connection, Pool, PoolExhausted
from distlocks.backends.postgres.sql import TABLE
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockError


@dataclass(slots=True)
class Held:
    """A lease this process holds: the connection it pins (session mode) or the
    caller's Django connection (transaction mode), and what giving it back needs."""

    conn: Connection
    key: int
    token: int
    #: "lock", or the permit kind (a permit is released only as that kind).
    kind: str = "lock"
    #: The statement that gives it back (parameters: key, reader).
    unlock: str = sql.UNLOCK
    #: A read lease's own registry row (0: none).
    reader: int = 0
    #: The name's guard key, taken (shared) by the statement that gives it back.
    guard: int = 0
    #: Transaction mode: the server's id of the transaction that holds it.
    transaction: str = ""
    #: Session-mode locks: the name's keys encoded for the fast path (session.Named).
    named: Any = None
    #: Session mode: a renewal's call is in flight on ``conn`` (under the held lock).
    busy: bool = False
    #: Session mode: released while that call was in flight; the call's thread then
    #: closes ``conn`` (see SessionLocks._release_session).
    abandoned: bool = False


#: Bounds of the fast path's caches of encoded parameters (per backend).
NAMES_CACHED = 4096
HOLDERS_CACHED = 1024


def encode(value: Any) -> bytes:
    """A parameter encoded ahead, in UTF-8 (sent only on a UTF-8 connection)."""
    if type(value) is str and "\x00" not in value:  # the owner id, on every acquire
        return value.encode()
    encoded = wire.encode(value, "utf-8")
    assert encoded is not None
    return encoded


class _MappedErrors:
    """The context of :meth:`PooledBackend._mapped_errors`: a class rather than a
    generator-based context manager, which costs several times more per use (it is
    entered on every acquire)."""

    __slots__ = ("action", "backend", "name")

    def __init__(self, backend: PooledBackend, action: str, name: str) -> None:
        self.backend = backend
        self.action = action
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, psycopg.Error):
            raise self.backend._mapped_error(self.action, self.name, exc) from exc


class PooledBackend(capabilities.Listing, capabilities.Waiting, capabilities.Permits, BaseBackend):
    """The state and helpers shared by the recipes (:mod:`.session`,
    :mod:`.transaction`, :mod:`.permits`, :mod:`.listing`); abstract."""

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
        self._pool: Pool | None = None
        self._pool_lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._held_lock = threading.Lock()
        # The fast path's parameters that do not change, encoded once (UTF-8): by
        # lock name (session mode), and by holder (one per thread: current_holder()).
        self._names: dict[str, Any] = {}
        self._holders: dict[int, tuple[Holder, bytes, bytes, bytes]] = {}

    def _connect_kwargs(self) -> dict[str, Any]:
        return configuration.connect_kwargs(self)

    @property
    def pool(self) -> Pool:
        """The pool of lock connections, apart from Django's (created on first use)."""
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = Pool(
                        self._connect_kwargs(),
                        max_size=self.options.get("pool_size", self.DEFAULT_POOL_SIZE),
                        timeout=self.options.get("pool_timeout", 5.0),
                        reply_timeout=self.options.get(
                            "socket_timeout", self.DEFAULT_SOCKET_TIMEOUT
                        ),
                    )
        return self._pool

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
        if isinstance(cause, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction):
            # The registry, or a table or function of a later migration (the token
            # ceiling and its marker, 0003; the mint, 0004): either way, the database is
            # behind distlocks' migrations.
            hint = (
                f" A table or function of distlocks is missing ({TABLE}, {sql.MINT}, or one"
                f" a later migration adds): run `manage.py migrate distlocks --database"
                f" {self.database}`."
            )
            if not apps.is_installed("distlocks"):
                # Without the app, that command answers "No installed app".
                hint += " First add 'distlocks' to INSTALLED_APPS: its migrations create them."
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

    def _mapped_error(self, action: str, name: str, exc: psycopg.Error) -> LockError:
        """A driver error as distlocks': an outage, or a LockError with a hint."""
        if isinstance(exc, psycopg.OperationalError):
            return self._unavailable(action, name, exc)
        return self._driver_error(action, name, exc)

    def _mapped_errors(self, action: str, name: str) -> _MappedErrors:
        """Driver errors as distlocks errors: an outage, or a LockError with a hint."""
        return _MappedErrors(self, action, name)

    @contextlib.contextmanager
    def _pooled(self, action: str, name: str) -> Iterator[Connection]:
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

    def _checkout(self, name: str, wait: float | None = None) -> Connection:
        """A pooled connection; a caller that may wait for its lock (``wait`` > 0)
        waits for a connection within that same budget."""
        timeout = wait if wait is not None and wait > 0 else None
        pool = self._pool
        try:
            return (self.pool if pool is None else pool).get(timeout)
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
        except OSError as exc:
            # Raised by the driver's poller, or by the duplicate of the new socket
            # (pool.Connection): not an outage of the server, but of this process.
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise self._out_of_descriptors(name, exc) from exc
            raise self._unavailable("connect for", name, exc) from exc

    def _out_of_descriptors(self, name: str, exc: OSError) -> LockError:
        try:
            import resource  # Unix only

            limit = f" (RLIMIT_NOFILE soft limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
        except ImportError:  # pragma: no cover - not on Unix
            limit = ""
        whose = (
            "the system has no file descriptor left (raise fs.file-max)"
            if exc.errno == errno.ENFILE
            else f"this process has no file descriptor left{limit}"
        )
        return LockError(
            f"No connection for lock {name!r} on backend {self.alias!r}: {whose}: {exc}. "
            f"Each PostgreSQL lock held or waited for keeps a connection open (its socket "
            f"and one duplicate of it, two descriptors). Raise the limit (`ulimit -n`, "
            f"LimitNOFILE= under systemd) or lower OPTIONS['pool_size'] (now "
            f"{self.pool.max_size}) to cap this backend's connections."
        )

    def _discard(self, conn: Connection) -> None:
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

    def _holder_columns(self, holder: Holder) -> tuple[Holder, bytes, bytes, bytes]:
        """``holder``'s host, pid and thread as the registry takes them, encoded
        (cached by the object, which is kept with them so its id is never reused)."""
        cached = self._holders.get(id(holder))
        if cached is None or cached[0] is not holder:
            cached = (
                holder,
                encode(holder.host[:255]),
                encode(holder.pid),
                encode(holder.thread[:255]),
            )
            if len(self._holders) >= HOLDERS_CACHED:
                self._holders.clear()
            self._holders[id(holder)] = cached
        return cached

    def _derived_key(self, name: str, *parts: str) -> int:
        # Names have no control characters: these never collide with a lock's key.
        return lock_key(self.key_prefix, "\x00".join((name, *parts)))

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
                        "SELECT pg_advisory_xact_lock(%(guard)s)",
                        {"guard": self._guard(name)},
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

    def _acquire_blocking(
        self,
        conn: Connection,
        params: dict[str, Any],
        wait: float,
        statement: str = sql.ACQUIRE_WAIT,
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
