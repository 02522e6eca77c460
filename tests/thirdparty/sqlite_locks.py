"""A third-party backend, written against the public contract only: locks in a SQLite file.

It is here to prove that a backend outside the distlocks package passes the backend kit
(``distlocks.testing.contract``); see tests/test_backend_kit.py and
docs/writing-a-backend.md, which walks through it. Every operation is one ``BEGIN
IMMEDIATE`` transaction, so it is atomic across the threads and the processes of one
machine that open the same file. Lease times are wall-clock times (``time.time()``):
the processes sharing the file share the machine's clock, and it is the server's clock
in this design.

Two classes show the narrow contract. :class:`MinimalSQLiteBackend` writes only what
every backend must have (acquire, release, extend, inspect, force_release,
fencing_counter) and declares no capability: locks, ``alock`` and ``lock_many`` work on
it (waiters poll), while semaphores, read-write locks and the live-locks listing give
the one clear "not supported" answer. :class:`SQLiteLockBackend` adds one capability,
:class:`~distlocks.backends.capabilities.Listing`, by one method (``iter_locks``). Neither
declares ``Waiting`` or ``Permits``, so the kit skips those tests and checks that
permits are refused clearly.

Settings::

    DISTLOCKS_BACKENDS = {
        "default": {
            "BACKEND": "tests.thirdparty.sqlite_locks.SQLiteLockBackend",
            "LOCATION": "/var/lib/myapp/locks.sqlite3",
            "OPTIONS": {"timeout": 5.0},
        },
    }
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo
from distlocks.backends.capabilities import Listing
from distlocks.exceptions import LockBackendUnavailable, LockError

SCHEMA = """
CREATE TABLE IF NOT EXISTS distlocks_lock (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    token INTEGER NOT NULL,
    acquired_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    ttl REAL NOT NULL,
    renewals INTEGER NOT NULL DEFAULT 0,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    thread TEXT NOT NULL,
    extra TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS distlocks_counter (
    name TEXT PRIMARY KEY,
    token INTEGER NOT NULL
);
"""
T = TypeVar("T")
_COLUMNS = "name, owner, token, acquired_at, expires_at, ttl, renewals, host, pid, thread, extra"


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


class MinimalSQLiteBackend(BaseBackend):
    """Locks and fencing counters in one SQLite file, shared by the processes of a host:
    the required methods only, no capability declared."""

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION"})
    option_keys: ClassVar[frozenset[str] | None] = frozenset({"timeout"})
    # The server (the file) frees a lease that ran out. Without the Waiting capability
    # the lock layer polls; without Permits there are no semaphores or read-write locks.
    expires_on_server: ClassVar[bool] = True

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.path: str = config["LOCATION"]
        self.timeout = float(self.options.get("timeout", 5.0))
        # One connection per process, used by one thread at a time: sqlite3 objects
        # are not safe to share concurrently, and a forked child must open its own.
        self._mutex = threading.Lock()
        self._connection: sqlite3.Connection | None = None
        self._pid = 0

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location = config.get("LOCATION")
        if not isinstance(location, str) or not location:
            problems.append("LOCATION must be the path of the SQLite file, as a non-empty str")
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping) and "timeout" in options:
            timeout = options["timeout"]
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
                problems.append(f"OPTIONS['timeout'] must be a positive number, not {timeout!r}")
        return problems

    # -- the connection ---------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        """This process's connection, opened (and the schema made) on first use."""
        if self._connection is None or self._pid != os.getpid():
            # A connection inherited through fork() belongs to the parent: not closed
            # here (that would disturb the parent's file locks), just never used.
            connection = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA synchronous=NORMAL")
                connection.executescript(SCHEMA)
            except BaseException:
                connection.close()
                raise
            self._connection, self._pid = connection, os.getpid()
        return self._connection

    def _run(self, what: str, step: Callable[[sqlite3.Cursor, float], T]) -> T:
        """``step(cursor, now)`` in one write transaction; driver errors wrapped."""
        with self._mutex:
            try:
                connection = self._connect()
                connection.execute("BEGIN IMMEDIATE")
                try:
                    result = step(connection.cursor(), time.time())
                except BaseException:
                    connection.execute("ROLLBACK")
                    raise
                connection.execute("COMMIT")
                return result
            except sqlite3.OperationalError as exc:
                # Locked beyond the timeout, or the file cannot be opened: unavailable.
                self._forget_connection()
                raise LockBackendUnavailable(self.alias, f"{what} failed: {exc}") from exc
            except sqlite3.Error as exc:
                self._forget_connection()
                raise LockError(f"{what} on backend {self.alias!r} failed: {exc}") from exc

    def _forget_connection(self) -> None:
        if self._connection is not None and self._pid == os.getpid():
            self._connection.close()
        self._connection = None

    def close(self) -> None:
        with self._mutex:
            self._forget_connection()

    # -- the contract -------------------------------------------------------------------

    @staticmethod
    def _next_token(cursor: sqlite3.Cursor, name: str) -> int:
        row = cursor.execute("SELECT token FROM distlocks_counter WHERE name = ?", (name,))
        found = row.fetchone()
        token = (found[0] if found else 0) + 1
        cursor.execute(
            "INSERT INTO distlocks_counter (name, token) VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET token = excluded.token",
            (name, token),
        )
        return token

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
        def step(cursor: sqlite3.Cursor, now: float) -> AcquireResult:
            cursor.execute(
                "DELETE FROM distlocks_lock WHERE name = ? AND expires_at <= ?", (name, now)
            )
            row = cursor.execute(
                "SELECT owner, token, expires_at FROM distlocks_lock WHERE name = ?", (name,)
            ).fetchone()
            if row is not None:
                if row[0] != owner:
                    return AcquireResult(False, 0, max(0.0, row[2] - now))
                # The same owner again (a retried call): same lease, new ttl.
                cursor.execute(
                    "UPDATE distlocks_lock SET expires_at = ?, ttl = ? WHERE name = ?",
                    (now + ttl, ttl, name),
                )
                return AcquireResult(True, row[1], ttl)
            token = self._next_token(cursor, name)
            cursor.execute(
                f"INSERT INTO distlocks_lock ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
                (name, owner, token, now, now + ttl, ttl, holder.host, holder.pid,
                 holder.thread, json.dumps(dict(holder.extra))),
            )  # fmt: skip
            return AcquireResult(True, token, ttl)

        return self._run(f"acquire {name!r}", step)

    def release(self, name: str, owner: str) -> bool:
        def step(cursor: sqlite3.Cursor, now: float) -> bool:
            cursor.execute(
                "DELETE FROM distlocks_lock WHERE name = ? AND owner = ? AND expires_at > ?",
                (name, owner, now),
            )
            return cursor.rowcount == 1

        return self._run(f"release {name!r}", step)

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        def step(cursor: sqlite3.Cursor, now: float) -> bool:
            cursor.execute(
                "UPDATE distlocks_lock SET expires_at = ?, ttl = ?, renewals = renewals + 1 "
                "WHERE name = ? AND owner = ? AND expires_at > ?",
                (now + ttl, ttl, name, owner, now),
            )
            return cursor.rowcount == 1

        return self._run(f"extend {name!r}", step)

    def force_release(self, name: str, token: int | None = None) -> bool:
        def step(cursor: sqlite3.Cursor, now: float) -> bool:
            row = cursor.execute(
                "SELECT token FROM distlocks_lock WHERE name = ? AND expires_at > ?", (name, now)
            ).fetchone()
            if row is None or (token is not None and row[0] != token):
                return False
            cursor.execute("DELETE FROM distlocks_lock WHERE name = ?", (name,))
            # The evicted holder's token is outdated before anyone acquires again.
            self._next_token(cursor, name)
            return True

        return self._run(f"force-release {name!r}", step)

    def fencing_counter(self, name: str) -> int:
        def step(cursor: sqlite3.Cursor, now: float) -> int:
            row = cursor.execute(
                "SELECT token FROM distlocks_counter WHERE name = ?", (name,)
            ).fetchone()
            return int(row[0]) if row else 0

        return self._run(f"read the counter of {name!r}", step)

    def _info(self, row: tuple[Any, ...]) -> LockInfo:
        name, owner, token, acquired, expires, ttl, renewals, host, pid, thread, extra = row
        return LockInfo(
            name=name, backend=self.alias, owner=owner, fencing_token=token, host=host,
            pid=pid, thread=thread, acquired_at=_utc(acquired), expires_at=_utc(expires),
            ttl=ttl, renewals=renewals, extra=json.loads(extra),
        )  # fmt: skip

    def inspect(self, name: str) -> LockInfo | None:
        def step(cursor: sqlite3.Cursor, now: float) -> LockInfo | None:
            row = cursor.execute(
                f"SELECT {_COLUMNS} FROM distlocks_lock WHERE name = ? AND expires_at > ?",
                (name, now),
            ).fetchone()
            return None if row is None else self._info(row)

        return self._run(f"inspect {name!r}", step)


class SQLiteLockBackend(Listing, MinimalSQLiteBackend):
    """:class:`MinimalSQLiteBackend` that can also list its locks (the admin page, the
    ``distlocks list`` command and the metrics then show them)."""

    def iter_locks(self) -> Iterator[LockInfo]:
        def step(cursor: sqlite3.Cursor, now: float) -> list[LockInfo]:
            rows = cursor.execute(
                f"SELECT {_COLUMNS} FROM distlocks_lock WHERE expires_at > ? ORDER BY name",
                (now,),
            ).fetchall()
            return [self._info(row) for row in rows]

        return iter(self._run("list the locks", step))
