"""The PostgreSQL lock implementations compared, and the database they run in.

All of them work in :data:`bench.settings.BENCH_DATABASE` on the throwaway server,
which the runner creates (:func:`prepare_database`) and migrates (:func:`migrate`:
distlocks needs its registry table, the save workloads of :mod:`bench.saves` the
tables of :mod:`bench.benchapp`) before any implementation is built. Advisory
locks are scoped to one database, and each implementation prefixes its lock names
with its own name, so they never take each other's locks.

A session-level advisory lock belongs to a server connection, and the same
connection taking it again just counts up (it is reentrant per session). So no
two threads may share a connection: the floor keeps one per thread,
django-pglock uses Django's connection (one per thread), distlocks pins a
pooled connection to each lease.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Any

from bench.base import BenchError, Env, Implementation, implementation
from bench.implementations import BackendLevel

#: A LIKE pattern matching every lock name the workloads use (see :mod:`bench.workloads`).
NAME_PATTERN = "bench:%"


def bench_conninfo(env: Env) -> str:
    """The connection string of the benchmark's database on the server of ``env``."""
    from psycopg.conninfo import make_conninfo

    from bench.settings import BENCH_DATABASE

    return make_conninfo(env.database_url, dbname=BENCH_DATABASE)


def prepare_database(env: Env) -> None:
    """Create the benchmark's database if missing (Django is not set up yet)."""
    import psycopg
    from psycopg import sql

    from bench.settings import BENCH_DATABASE

    with psycopg.connect(env.database_url, autocommit=True, connect_timeout=5) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (BENCH_DATABASE,)
        ).fetchone()
        if exists is None:
            # A concurrent run may create it between the look-up and here.
            with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(BENCH_DATABASE)))


def migrate(database: str = "default") -> None:
    """Run the migrations into the benchmark's database (after ``django.setup()``)."""
    from django.core.management import call_command

    call_command("migrate", database=database, interactive=False, verbosity=0)


def clean_database(env: Env) -> None:
    """Drop the registry rows of the run's lock names, as the Redis keys are dropped.

    The rows hold the fencing counters of names only the benchmark uses; without
    them, every run starts from the same empty table. The save workloads delete
    their rows themselves; their tables are vacuumed too, so the dead row versions
    of thousands of saves do not carry over to the next run.
    """
    import psycopg
    from psycopg import sql

    from bench.benchapp.models import FencedRow, PlainRow
    from distlocks.backends.postgres import TABLE

    with psycopg.connect(bench_conninfo(env), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"DELETE FROM {TABLE} WHERE name LIKE %s", (NAME_PATTERN,))
        conn.execute(f"VACUUM {TABLE}")
        for model in (PlainRow, FencedRow):
            conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(model._meta.db_table)))


def server_version(env: Env) -> str:
    if not env.database_url:
        return ""
    import psycopg

    try:
        with psycopg.connect(env.database_url, connect_timeout=2) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error as exc:
        return f"unknown ({type(exc).__name__})"
    return str(row[0]).split()[0] if row else ""


def advisory_key(name: str) -> int:
    """A signed 64-bit key from a lock name: the first 8 bytes of its SHA-256."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@implementation
class PgFloor(Implementation):
    """psycopg with nothing on top: ``pg_try_advisory_lock`` and ``pg_advisory_unlock``.

    One autocommit connection per thread, opened once. Blocking is the server's own
    lock queue: ``pg_advisory_lock`` under a ``lock_timeout`` set only when it changes.
    """

    name = "pg-floor"
    label = "raw pg_try_advisory_lock + pg_advisory_unlock"
    role = "floor"
    family = "postgres"
    servers = frozenset({"postgres"})
    distribution = "psycopg"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self._conninfo = bench_conninfo(env)
        self._local = threading.local()
        self._opened: list[Any] = []
        self._opened_lock = threading.Lock()

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            import psycopg

            conn = psycopg.connect(self._conninfo, autocommit=True)
            self._local.conn = conn
            self._local.lock_timeout_ms = 0
            with self._opened_lock:
                self._opened.append(conn)
        return conn

    def try_acquire(self, name: str, ttl: float) -> tuple[Any, int] | None:
        conn = self._conn()
        key = advisory_key(name)
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        return (conn, key) if row[0] else None

    def release(self, handle: tuple[Any, int]) -> None:
        conn, key = handle
        conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> tuple[Any, int] | None:
        import psycopg.errors

        conn = self._conn()
        key = advisory_key(name)
        timeout_ms = max(1, round(timeout * 1000))
        if self._local.lock_timeout_ms != timeout_ms:
            conn.execute(f"SET lock_timeout = {timeout_ms}")
            self._local.lock_timeout_ms = timeout_ms
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        except psycopg.errors.LockNotAvailable:
            return None
        return conn, key

    def thread_start(self) -> None:
        self._conn()

    def thread_done(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            with self._opened_lock:
                self._opened.remove(conn)
            conn.close()

    def close(self) -> None:
        with self._opened_lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            conn.close()


@implementation
class DistlocksPg(Implementation):
    """distlocks through its public API on PostgreSQL: ``with lock(name, backend="pg", ...):``."""

    name = "distlocks-pg"
    label = 'distlocks lock(backend="pg") (public API)'
    role = "distlocks"
    family = "postgres"
    servers = frozenset({"postgres"})
    distribution = "distlocks"
    reference = True
    alias = "pg"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from distlocks import lock
        from distlocks.exceptions import LockNotAcquired

        self._lock = lock
        self._not_acquired = LockNotAcquired

    def cycle(self, name: str, ttl: float) -> None:
        with self._lock(name, backend=self.alias, ttl=ttl, timeout=0):
            pass

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        try:
            return self._lock(name, backend=self.alias, ttl=ttl, timeout=0).acquire()
        except self._not_acquired:
            return None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        try:
            return self._lock(name, backend=self.alias, ttl=ttl, timeout=timeout).acquire()
        except self._not_acquired:
            return None

    def close(self) -> None:
        from distlocks.handler import backends

        backends.reset()


@implementation
class DistlocksPgBackend(BackendLevel):
    """distlocks one layer down: ``PostgresBackend.acquire`` / ``release``, no Lease.

    The gap to ``pg-floor`` is the registry upsert (fencing token and holder row) and
    the connection pool; the gap to ``distlocks-pg`` is the public API layer.
    """

    name = "distlocks-pg-backend"
    label = "distlocks PostgresBackend.acquire/release"
    role = "distlocks"
    family = "postgres"
    servers = frozenset({"postgres"})
    distribution = "distlocks"
    workloads = frozenset(
        {"cycle", "throughput-threads", "throughput-processes", "pg-cycle-durable"}
    )

    backend_alias = "pg"


@implementation
class DjangoPglock(Implementation):
    """django-pglock's ``pglock.advisory()``: a session advisory lock on Django's connection.

    It has no lease length (the lock lasts until released or the connection ends) and
    no fencing token. Waiting is ``pg_advisory_lock`` under a ``lock_timeout`` that it
    sets before and resets after each wait.
    """

    name = "django-pglock"
    label = "django-pglock advisory()"
    role = "peer"
    family = "postgres"
    servers = frozenset({"postgres"})
    distribution = "django-pglock"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        import pglock

        self._advisory = pglock.advisory

    def cycle(self, name: str, ttl: float) -> None:
        with self._advisory(name, timeout=0) as acquired:
            if not acquired:
                raise BenchError(f"{self.name}: lock {name!r} was busy in an uncontended cycle")

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        lock = self._advisory(name, timeout=0)
        return lock if lock.acquire() else None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        lock = self._advisory(name, timeout=timeout)
        return lock if lock.acquire() else None

    def thread_start(self) -> None:
        from django.db import connections

        connections["default"].ensure_connection()

    def thread_done(self) -> None:
        from django.db import connections

        # Django's connections are per thread: this closes the calling thread's only.
        connections.close_all()

    def close(self) -> None:
        self.thread_done()
