"""Releases that wait for the database transaction: a lease released inside
``transaction.atomic()`` is freed when that transaction ends.

Why: a holder that writes rows under a lock inside a transaction and frees the lock
before the COMMIT lets the next holder read the rows as they were and write over the
change. Under ``ATOMIC_REQUESTS`` every view is in that position. So
:meth:`distlocks.lease.Lease.release`, called while a connection of this thread is
inside an atomic block, leaves the lock held (and renewed) and frees it when every
such transaction has committed or rolled back.

How the end of a transaction is seen, with public Django API only: the release is
registered with ``connection.on_commit()``, which runs it after the COMMIT. Django
has no rollback hook; it *discards* the callbacks of a transaction that rolls back
(and of a connection closed inside one). The registered object is referenced by
nothing but Django's list of callbacks, so a ``weakref.finalize`` on it fires the
moment Django drops it: that is the rollback hook. Dropped by the rollback of a
savepoint while the outer transaction goes on, it is registered again at the outer
level, so the lock is kept until the outermost transaction ends.

Transactions opened by Django's ``TestCase`` never commit: a connection whose
outermost atomic block is a test case's is treated as having no transaction.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from django.db import connections

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from distlocks.backends.base import LeaseServer
    from distlocks.lease import Lease

logger = logging.getLogger(__name__)

#: Leases whose release waits for a transaction, by (thread id, backend alias, kind,
#: name): the same thread taking the same lock again before the COMMIT gets its lease
#: back instead of waiting for itself.
pending: dict[tuple[int, str, str, str], Lease] = {}
_pending_guard = threading.Lock()


def open_transactions() -> list[BaseDatabaseWrapper]:
    """This thread's connections inside an atomic block that will commit or roll back
    (not a test case's). Connections never used by this thread are not looked at."""
    found = []
    for conn in _connections():
        if conn.in_atomic_block:
            blocks = conn.atomic_blocks
            # Django marks the atomic blocks of TestCase (the attribute that its own
            # durable=True check reads): that transaction never commits.
            if blocks and getattr(blocks[0], "_from_testcase", False):
                continue
            found.append(conn)
    return found


def _connections() -> Sequence[BaseDatabaseWrapper]:
    """This thread's initialized connections, as ``connections.all(initialized_only=True)``
    lists them: read from the thread's own storage where Django keeps them (see
    :func:`_sync_storage`), one dictionary for all aliases, instead of two lookups per
    alias through asgiref's ``Local`` (each raising and catching an exception, about
    13 us per release with two aliases of which one unused by the thread)."""
    # Not in an event loop's thread: there each asyncio context has connections of its
    # own (and Django runs no transaction there anyway).
    if asyncio._get_running_loop() is None:
        storage = _sync_storage()
        if storage is not None:
            found = storage.__dict__
            return [found[alias] for alias in connections.settings if alias in found]
    return connections.all(initialized_only=True)


def _sync_storage() -> threading.local | None:
    """Where Django keeps a sync thread's connections, when it keeps them as Django 4+
    with asgiref 3 do: its handler's ``asgiref.local.Local(thread_critical=True)``
    holds, for a thread running no event loop, a plain ``threading.local`` whose
    attributes are the aliases this thread initialized. None if not (another layout):
    the public lookup is used then."""
    global _storage_seen
    try:
        local = connections._connections  # type: ignore[attr-defined]
    except AttributeError:
        return None
    seen = _storage_seen
    if seen[0] is local:
        # The handler's Local and its storage live as long as each other: what was
        # found for this Local holds (a new handler or Local is looked at anew).
        return seen[1]
    try:
        storage = object.__getattribute__(local, "_storage")
    except AttributeError:
        storage = None
    if type(local).__name__ != "_ThreadCriticalLocal" or type(storage) is not threading.local:
        storage = None
    _storage_seen = (local, storage)
    return storage


#: (the connection handler's Local, the storage _sync_storage() found in it).
_storage_seen: tuple[object, threading.local | None] = (None, None)


def _key(backend: LeaseServer, name: str) -> tuple[int, str, str, str]:
    return (threading.get_ident(), backend.alias, str(getattr(backend, "kind", "lock")), name)


class Deferral:
    """One release waiting for the transactions of one or more connections."""

    __slots__ = ("aliases", "key", "lease")

    def __init__(self, lease: Lease, key: tuple[int, str, str, str]) -> None:
        self.lease = lease
        self.key = key
        #: Aliases whose transaction has not ended yet.
        self.aliases: set[str] = set()

    def ended(self, alias: str) -> None:
        """The transaction on ``alias`` committed or rolled back."""
        if not self.current():
            return
        self.aliases.discard(alias)
        if self.aliases:
            return
        forget(self)
        self.lease._release_deferred(self)

    def current(self) -> bool:
        """False once called off (the lease was taken back by a new acquisition; a
        later release of it waits with a deferral of its own)."""
        return self.lease._deferral is self


class _Hook:
    """The callable given to ``on_commit``; only Django's callback list refers to it."""

    __slots__ = ("__weakref__", "alias", "deferral", "done")

    def __init__(self, deferral: Deferral, alias: str) -> None:
        self.deferral = deferral
        self.alias = alias
        # Shared with the finalizer (which must not refer to the hook itself).
        self.done = [False]

    def __call__(self) -> None:
        """After the COMMIT. Never raises: the transaction is already committed, and
        an error here would reach the code leaving ``atomic()`` as if it had failed."""
        self.done[0] = True
        _end(self.deferral, self.alias)


def _register(deferral: Deferral, conn: BaseDatabaseWrapper) -> None:
    hook = _Hook(deferral, conn.alias)
    depth = len(conn.savepoint_ids)
    finalizer = weakref.finalize(
        hook, _dropped, deferral, weakref.ref(conn), conn.alias, depth, hook.done
    )
    # At interpreter exit the process and its connections end: nothing to do.
    finalizer.atexit = False
    conn.on_commit(hook, robust=True)
    # First in line: Django stops running commit callbacks at the first one that
    # raises, and keeps the rest alive with the exception's traceback, so a release
    # queued behind a failing callback would wait for that exception to be collected.
    # Ahead of the other callbacks, behind earlier releases (released in order).
    hooks = conn.run_on_commit
    if hooks and hooks[-1][1] is hook:
        entry = hooks.pop()
        first_other = next(
            (i for i, queued in enumerate(hooks) if not isinstance(queued[1], _Hook)),
            len(hooks),
        )
        hooks.insert(first_other, entry)


def _dropped(
    deferral: Deferral,
    conn_ref: weakref.ref[BaseDatabaseWrapper],
    alias: str,
    depth: int,
    done: list[bool],
) -> None:
    """Django let go of the hook: after running it (COMMIT), or without running it
    (ROLLBACK, a savepoint's rollback, the connection closed). Runs in the thread
    that owns the connection, as Django lets only that thread use it."""
    if done[0] or not deferral.current():
        return
    try:
        conn = conn_ref()
        if (
            conn is not None
            and conn.in_atomic_block
            and len(conn.savepoint_ids) < depth
            and not conn.closed_in_transaction
            and conn.connection is not None
        ):
            # A savepoint rolled back (its block is already off the stack) and the
            # outer transaction goes on: wait for that one.
            _register(deferral, conn)
            return
    except Exception:
        logger.exception("Could not check the transaction of lock %r", deferral.lease.name)
    _end(deferral, alias)


def _end(deferral: Deferral, alias: str) -> None:
    try:
        deferral.ended(alias)
    except Exception:
        # Raised in a commit hook or a weakref callback, it would be lost or misread.
        logger.exception(
            "Could not release lock %r after its transaction ended; it ends by expiry "
            "or when its connection closes",
            deferral.lease.name,
        )


def defer(lease: Lease, conns: list[BaseDatabaseWrapper]) -> Deferral:
    """Release ``lease`` once the transactions of ``conns`` have all ended."""
    key = _key(lease._backend, lease.name)
    deferral = Deferral(lease, key)
    deferral.aliases = {conn.alias for conn in conns}
    with _pending_guard:
        pending[key] = lease
    for conn in conns:
        _register(deferral, conn)
    return deferral


def take_back(backend: LeaseServer, name: str) -> Lease | None:
    """This thread's lease on ``name`` whose release waits for a transaction, now
    held again by the caller (its pending release cancelled), or None."""
    with _pending_guard:
        lease = pending.pop(_key(backend, name), None)
    if lease is None or not lease._cancel_deferred_release():
        return None
    return lease


def forget(deferral: Deferral | None) -> None:
    """Drop the take-back entry of a release that will not wait any more."""
    if deferral is None:
        return
    with _pending_guard:
        if pending.get(deferral.key) is deferral.lease:
            del pending[deferral.key]


def _forget_all_after_fork() -> None:
    """A forked child holds none of its parent's leases (the fork rule); the guard is
    renewed too, as another thread of the parent may have held it at the fork."""
    global _pending_guard
    pending.clear()
    _pending_guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_after_fork)
