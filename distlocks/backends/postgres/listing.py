"""Listing: the live locks, permits and read-write leases of a database, read from
``pg_locks`` joined with the registry (names, tokens, holders) and
``pg_stat_activity`` (the holder's session), for the admin page and ``inspect()``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping
from typing import Any

from distlocks.backends.base import LockInfo, holder_details
from distlocks.backends.postgres import sql
from distlocks.backends.postgres.connections import PooledBackend


class Listing(PooledBackend):
    """``inspect()``, ``iter_locks()`` and the rows behind the permit listings."""

    def _rows(
        self, where: str = "", params: tuple[Any, ...] = (), name: str = "locks"
    ) -> list[LockInfo]:
        """The rows ``where`` selects; ``name`` is what an error message calls them."""
        query = sql.LOCKS + where + " ORDER BY acquired_at"
        with self._pooled("list", name) as conn:
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
        rows = self._rows(" AND lkey = %s AND mode = 'ExclusiveLock'", (self.key(name),), name)
        return rows[0] if rows else None

    def iter_locks(self) -> Iterator[LockInfo]:
        """Every live lock, semaphore permit and read-write lease, in one query: with
        many locks, most of the time goes to turning rows into objects, so this does as
        little per row as it can."""
        with self._pooled("list", "locks") as conn:
            rows = conn.execute(sql.LISTING).fetchall()
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
