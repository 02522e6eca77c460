"""The fork rule: a forked child never uses its parent's connections.

A child that inherits a lock connection shares the parent's server session, and
with it the parent's locks: a statement of the child's would run in that session,
and closing the connection would end it (and free the parent's locks). So at fork
the child forgets every pool and held lease of every backend instance, keeping the
objects referenced (never closed, never garbage-collected into a close), and
remembers which of Django's connections it inherited so that transaction mode
refuses to lock on them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from django.db import connections

from distlocks.backends.postgres.pool import watchdog

if TYPE_CHECKING:
    from distlocks.backends.postgres.base import PostgresBackend

instances: weakref.WeakSet[PostgresBackend] = weakref.WeakSet()
# Connections inherited by a forked child: kept referenced and never closed there,
# since closing would end the parent's sessions (and its locks) on the server.
inherited: list[Any] = []


# Django's own connections a forked child inherited (transaction mode runs on them),
# by id; the objects themselves are kept in inherited, so an id is never reused.
inherited_django: set[int] = set()


def forget_connections_after_fork() -> None:
    try:
        for wrapper in connections.all(initialized_only=True):
            raw = wrapper.connection
            if raw is not None:
                inherited.append(raw)
                inherited_django.add(id(raw))
    except Exception:  # no settings in this process: no Django connection either
        pass
    for backend in list(instances):
        inherited.append((backend._pool, backend._held))
        _close_duplicates(backend)
        backend._pool = None
        backend._held = {}
        backend._pool_lock = threading.Lock()
        backend._held_lock = threading.Lock()
    watchdog.after_fork()


def _close_duplicates(backend: PostgresBackend) -> None:
    """Close this process's copies of the descriptors the inherited connections made
    to shut their sockets down (pool.Connection._own_socket): never used here, they
    would double the descriptors a child of a parent with many locks starts with.
    Closing a copy never ends the socket, which the parent still has open; and the
    connection's shutdown becomes a no-op here, so nothing in the child can cut the
    parent's session through it. Its lock is not taken: a thread of the parent may
    have held it at the fork."""
    pool = backend._pool
    conns = [held.conn for held in backend._held.values()]
    if pool is not None:
        conns += pool._idle
    for conn in conns:
        own = getattr(conn, "_own_socket", None)
        if own is not None:
            conn._own_socket = None
            with contextlib.suppress(OSError):  # already closed
                own.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_connections_after_fork)
