"""The PostgreSQL backend's class: the backend contract, each method short and
handing the work to the module of its concern.

- :mod:`.configuration`: what the settings may be; the lock connections' settings.
- :mod:`.sql`: every statement, free of I/O; :mod:`.keys`: names to advisory keys.
- :mod:`.pool`: the lock connections' pool and its reply watchdog (the transport);
  :mod:`.fork`: a forked child never uses its parent's connections.
- :mod:`.connections`: checkout, held leases and error mapping, which the recipes share.
- :mod:`.session`, :mod:`.transaction`: the lock recipe of each mode.
- :mod:`.permits`: semaphores and read-write locks; :mod:`.listing`: live locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from django.core.checks import CheckMessage
from django.db import connections

from distlocks.backends.base import READ, SEMAPHORE, WRITE, AcquireResult, Holder
from distlocks.backends.postgres import configuration, fork, sql
from distlocks.backends.postgres.keys import key_parts
from distlocks.backends.postgres.permits import Permits
from distlocks.backends.postgres.session import SessionLocks
from distlocks.backends.postgres.transaction import TransactionLocks


class PostgresBackend(SessionLocks, TransactionLocks, Permits):
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

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        # Permits pin a session like session-mode locks; a transaction ends them all.
        if self.mode == "session":
            self.permit_kinds = frozenset({SEMAPHORE, READ, WRITE})
        fork.instances.add(self)

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
        return configuration.config_problems(cls, alias, config)

    @classmethod
    def check_config(cls, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        """System-check messages, with the dedicated IDs E008 and E009."""
        problems = [("E004", p) for p in super().validate_config(alias, config)]
        return configuration.check_messages(alias, problems + cls._problems(alias, config))

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
        return self._acquire_session(name, owner, ttl, holder, wait)

    def release(self, name: str, owner: str) -> bool:
        if self.mode == "transaction":
            return self._release_xact(name, owner)
        return self._release_session(name, owner)

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Confirm the lease: its connection is alive and still holds the lock."""
        if self.mode == "transaction":
            return self._xact_held(owner)
        return self._extend_session(owner)

    def force_release(self, name: str, token: int | None = None) -> bool:
        key = self.key(name)
        classid, objid = key_parts(key)
        params = {"key": key, "classid": classid, "objid": objid, "token": token}
        if self.mode == "transaction":
            return self._force_release_xact(name, params)
        return self._force_release_session(name, token, params)

    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none)."""
        with connections[self.database].cursor() as cursor:
            cursor.execute(sql.COUNTER, [self.key(name)])
            row = cursor.fetchone()
        return int(row[0]) if row else 0

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        """Nothing to do: :meth:`acquire` already waited in the server's queue."""

    def held_connection_count(self) -> int:
        """Connections currently pinned to leases (for tests and metrics)."""
        with self._held_lock:
            return len(self._held)
