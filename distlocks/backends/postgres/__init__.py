"""PostgreSQL advisory-lock backend.

Locks are PostgreSQL advisory locks on a 64-bit key derived from the lock name
with SHA-256 (never crc32 or ``hashtext``, which collide). The
``distlocks_lockregistry`` table (a migration of this app; UNLOGGED) maps keys back
to names and keeps the strictly increasing per-name fencing counter; the logged
``distlocks_lockfence`` row keeps a ceiling above every token issued, and the unlogged
``distlocks_lockepoch`` row marks the server's lifetime since its last crash, so that
a crash, which empties the registry, never issues a token again.
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

The package holds one concern a module; :mod:`.base` lists them.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

try:
    import psycopg  # noqa: F401 - imported first so that its absence says what to install
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.postgres.PostgresBackend needs psycopg 3: "
        "pip install 'distlocks[postgres]'."
    ) from exc

from distlocks.backends.postgres import sql
from distlocks.backends.postgres.base import PostgresBackend
from distlocks.backends.postgres.configuration import MODES
from distlocks.backends.postgres.keys import key_parts, lock_key
from distlocks.backends.postgres.pool import NoAnswer, PoolExhausted
from distlocks.backends.postgres.sql import (
    TABLE,
    TRY,
    TRY_SHARED,
    TRY_XACT,
    WAIT,
    WAIT_SHARED,
    WAIT_XACT,
)

# The statements under the names they had when this package was one module (the
# benchmarks build variants of them). Copies: to change what the backend sends,
# patch distlocks.backends.postgres.sql.
_ACQUIRE = sql.ACQUIRE
_BUMP = sql.BUMP
_CLOCK_US = sql.CLOCK_US
_LOCKS = sql.LOCKS
_UNLOCK = sql.UNLOCK

__all__ = [
    "MODES",
    "TABLE",
    "TRY",
    "TRY_SHARED",
    "TRY_XACT",
    "WAIT",
    "WAIT_SHARED",
    "WAIT_XACT",
    "_ACQUIRE",
    "_BUMP",
    "_CLOCK_US",
    "_LOCKS",
    "_UNLOCK",
    "NoAnswer",
    "PoolExhausted",
    "PostgresBackend",
    "key_parts",
    "lock_key",
]
