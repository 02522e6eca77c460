"""Transaction mode's lock recipe: a transaction-level advisory lock taken on
Django's own connection inside ``transaction.atomic()``.

The lock ends at COMMIT or ROLLBACK and cannot be released early; it is safe behind
a transaction-pooling proxy. The token and the holder are written to the registry on
a pooled connection of the backend's own, committed at once, so that the listing
and a force release see them before the caller's transaction commits.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
import psycopg.errors
from django.db import connections, transaction

from distlocks.backends.base import AcquireResult, Holder
from distlocks.backends.postgres import fork, sql
from distlocks.backends.postgres.connections import Held, PooledBackend
from distlocks.backends.postgres.keys import key_parts
from distlocks.exceptions import LockError


class TransactionLocks(PooledBackend):
    """Transaction-mode locks (the contract's dispatch is in :mod:`.base`)."""

    def _django_connection(self, name: str) -> Any:
        conn = connections[self.database]
        if fork.inherited_django and id(conn.connection) in fork.inherited_django:
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
                f"is released at COMMIT or ROLLBACK. alock() cannot use transaction mode (it "
                f"runs the call in a worker thread, outside your atomic block): use a "
                f"session-mode alias, or take the lock in synchronous code (sync_to_async)."
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
        # The lock and its registry write are all or nothing: a transaction-level lock
        # cannot be unlocked, only rolled back with the savepoint it was taken in. A
        # registry write that fails (a database behind migration 0004, a name past the
        # registry's width, the lock connections unreachable) must not leave the
        # caller's transaction holding a lock that no one sees, until it ends.
        with conn.cursor() as cursor:
            cursor.execute("SAVEPOINT distlocks_lock")
        try:
            token = self._lock_and_register(conn, params, wait)
        except BaseException:
            with contextlib.suppress(Exception), conn.cursor() as cursor:
                cursor.execute("ROLLBACK TO SAVEPOINT distlocks_lock")
                cursor.execute("RELEASE SAVEPOINT distlocks_lock")
            raise
        with conn.cursor() as cursor:
            cursor.execute("RELEASE SAVEPOINT distlocks_lock")  # the lock stays, in the caller's
        if token is None:
            return AcquireResult(False, 0, None)
        with self._held_lock:
            self._held[owner] = Held(
                conn.connection,
                params["key"],
                token,
                transaction=self._transaction_id(conn),
            )
        # Forget it when the transaction commits (a rollback is caught by _prune_xact).
        transaction.on_commit(lambda: self._forget(owner), using=self.database)
        return AcquireResult(True, token, None)

    def _lock_and_register(self, conn: Any, params: dict[str, Any], wait: float) -> int | None:
        """Take the transaction-level lock (one try, or a wait of ``wait`` seconds) and
        write its token and holder to the registry: the token, or None when not
        granted."""
        with conn.cursor() as cursor:
            if wait <= 0:
                cursor.execute(sql.TRY_XACT, params)
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
                    cursor.execute(sql.WAIT_XACT, params)
                    granted = cursor.fetchone() is not None
                except Exception as exc:
                    cursor.execute("ROLLBACK TO SAVEPOINT distlocks_wait")
                    if getattr(exc, "__cause__", None) is not None and isinstance(
                        exc.__cause__, psycopg.errors.LockNotAvailable
                    ):
                        return None
                    raise
                finally:
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
                    cursor.execute("RELEASE SAVEPOINT distlocks_wait")
        if not granted:
            return None
        # The token and the holder are written on a connection of our own, committed at
        # once: written in the caller's transaction they would stay invisible to
        # everyone else (the listing, a force release) until it commits. The lock is
        # already held, so no one else can mint a token for this name meanwhile.
        params["backend_pid"] = conn.connection.info.backend_pid
        with self._pooled("acquire", params["name"]) as registry:
            row = registry.execute(sql.REGISTER_XACT, params).fetchone()
        return int(row[0]) if row else 0

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
            cursor.execute(sql.HOLDS, [classid, objid])
            return bool(cursor.fetchone()[0])

    def _release_xact(self, name: str, owner: str) -> bool:
        # A transaction-level lock cannot be released early: it ends with the
        # transaction. Forget it here; report whether it was still ours.
        held = self._xact_held(owner)
        with self._held_lock:
            self._held.pop(owner, None)
        return held

    def _force_release_xact(self, name: str, params: dict[str, Any]) -> bool:
        """End the session whose transaction holds ``name`` (if its token is the one
        given): one statement, no guard (see sql.FORCE_RELEASE_XACT)."""
        with self._pooled("force-release", name) as conn:
            conn.lock_wait = 5.0  # the statement waits for the session to end
            try:
                row = conn.execute(sql.FORCE_RELEASE_XACT, params).fetchone()
            finally:
                conn.lock_wait = 0.0
        return bool(row and row[0])
