"""Permits (session mode): semaphores and read-write locks.

A semaphore of N permits is N advisory-lock slots, tried in order; a read-write lock
is one advisory key, locked shared by readers and exclusively by a writer (whose
registry row keeps the write fencing counter). Each holder's registry row says what
it belongs to in ``extra``: ``kind`` and ``of`` (the semaphore's or read-write lock's
own key, as text). A permit pins its connection like a session-mode lock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

from distlocks.backends.base import (
    SEMAPHORE,
    WRITE,
    AcquireResult,
    Holder,
    LockInfo,
    permit_family,
)
from distlocks.backends.postgres import sql
from distlocks.backends.postgres.connections import Held
from distlocks.backends.postgres.keys import slot_keys
from distlocks.backends.postgres.listing import Listing
from distlocks.backends.postgres.pool import Connection


class Permits(Listing):
    """The contract's permit methods; listing rows come from :mod:`.listing`."""

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
        reader, unlock = 0, sql.UNLOCK
        if kind == SEMAPHORE:
            extra["limit"] = limit
            keys = slot_keys(self.key_prefix, name, limit)
            params.update(keys=keys, limit=limit)
            statement, waits = sql.SEM_ACQUIRE, False
        elif kind == WRITE:
            statement = sql.WRITE_ACQUIRE.format(lock=sql.WAIT if wait > 0 else sql.TRY)
            waits = wait > 0
        else:
            reader, unlock = self._derived_key(name, "rwlock", owner), sql.READ_UNLOCK
            params["reader"] = reader
            statement = sql.READ_ACQUIRE.format(
                lock=sql.WAIT_SHARED if wait > 0 else sql.TRY_SHARED
            )
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
        held = Held(
            conn,
            key,
            token,
            kind=kind,
            unlock=unlock,
            reader=reader,
            guard=self._guard(name),
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
        return self._rows(" AND extra->>'of' = %s", (str(self._of(kind, name)),), name)

    def iter_permits(self) -> Iterator[LockInfo]:
        yield from self._rows(" AND extra->>'of' IS NOT NULL", name="permits")

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        self.check_permit_kind(kind)
        of = self._of(kind, name)

        def evict(conn: Connection) -> int:
            rows = conn.execute(sql.PERMIT_TARGETS, {"of": str(of), "owner": owner}).fetchall()
            if not rows:
                return 0  # no such holder: nothing is written
            if permit_family(kind) != SEMAPHORE:
                # The write counter moves on, so an evicted writer's writes are refused.
                conn.execute(sql.BUMP, {"key": of})
            ended = conn.execute(sql.TERMINATE, {"pids": [row[0] for row in rows]}).fetchone()
            return int(ended[0]) if ended else 0

        return int(self._guarded("force-release", name, evict))

    def permit_counter(self, name: str) -> int:
        self.check_permit_kind(WRITE)
        with self._pooled("read the write counter of", name) as conn:
            row = conn.execute(sql.COUNTER, (self._of(WRITE, name),)).fetchone()
        return int(row[0]) if row else 0
