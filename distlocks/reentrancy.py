"""Which reentrant leases the current thread or asyncio task holds.

Keyed by (backend alias, lock name, thread id, task): two ``lock(...,
reentrant=True)`` objects for the same name, used in nested calls by the same
thread, share one lease. A task never inherits its parent's holds, unlike a
context variable, so a lease cannot leak into concurrently running tasks.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distlocks.lease import BaseLease

_holds: dict[tuple[str, str, int, int], BaseLease] = {}
_guard = threading.Lock()


def _key(alias: str, name: str) -> tuple[str, str, int, int]:
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return (alias, name, threading.get_ident(), id(task) if task is not None else 0)


def current(alias: str, name: str) -> BaseLease | None:
    """The reentrant lease on ``name`` held by the caller, if any."""
    with _guard:
        return _holds.get(_key(alias, name))


def remember(lease: BaseLease) -> None:
    key = _key(lease.backend, lease.name)
    with _guard:
        _holds[key] = lease
    lease._reentrant_key = key  # type: ignore[attr-defined]


def _forget_all_after_fork() -> None:
    """A forked child holds none of its parent's leases (the fork rule): a reentrant
    ``lock()`` there is a new caller, not a re-entry (the forking thread keeps its
    id in the child, so the parent's holds would otherwise match). The guard is
    renewed too: another thread of the parent may have held it at the fork."""
    global _guard
    _holds.clear()
    _guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_after_fork)


def forget(lease: BaseLease) -> None:
    key = getattr(lease, "_reentrant_key", None)
    if key is None:
        return
    with _guard:
        if _holds.get(key) is lease:
            del _holds[key]
