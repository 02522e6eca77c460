"""The process-wide lease renewer: one thread, however many leases.

Leases are kept in a heap ordered by their next renewal time. The thread sleeps
until the earliest one is due, renews it (one compare-and-expire round trip),
and schedules it again at a third of its ttl. It exits after a while with
nothing to do and is started again by the next lease, and it is rebuilt in a
forked child (threads do not survive ``fork``).

The heap holds weak references: a lease that its holder dropped without
releasing is released at its next renewal time instead of being kept alive for
as long as the process runs.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from distlocks.lease import release_dropped

if TYPE_CHECKING:
    from distlocks.lease import Lease

logger = logging.getLogger(__name__)

#: Seconds the thread lingers with no lease before exiting.
IDLE_EXIT = 30.0


class Renewer:
    """Renews the leases of one backend (so a hung server delays only its own leases)."""

    def __init__(self, alias: str = "") -> None:
        self.alias = alias
        self._heap: list[
            tuple[float, int, weakref.ref[Lease], tuple[Any, str, str, dict[str, bool]]]
        ] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._finished = 0  # entries in the heap whose lease has ended

    def add(self, lease: Lease, due: float) -> None:
        """Renew ``lease`` at monotonic time ``due`` (and after that as it asks)."""
        with self._cond:
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (due, next(self._seq), weakref.ref(lease), _ident(lease)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=f"distlocks-renewer:{self.alias}", daemon=True
                )
                self._thread.start()
            elif earliest is None or due < earliest:
                # Wake the thread only if it now has to run sooner than planned.
                self._cond.notify()

    def finished(self) -> None:
        """A lease ended; compact the heap once ended leases dominate it."""
        with self._cond:
            self._finished += 1
            if self._finished > 64 and self._finished * 2 > len(self._heap):
                self._heap = [
                    entry
                    for entry in self._heap
                    if (lease := entry[2]()) is None or lease._state == "held"
                ]
                heapq.heapify(self._heap)
                self._finished = 0

    def _next(self) -> Lease | None:
        """Wait for the next due lease; None when idle long enough to exit."""
        idle_since = time.monotonic()
        with self._cond:
            while True:
                if not self._heap:
                    if time.monotonic() - idle_since >= IDLE_EXIT:
                        self._thread = None
                        return None
                    self._cond.wait(IDLE_EXIT)
                    continue
                due, _, ref, ident = self._heap[0]
                delay = due - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
                lease = ref()
                if lease is None:
                    # Dropped by its holder without a release: nobody can release it
                    # now, so do it here (outside the lock) rather than renew it.
                    self._cond.release()
                    try:
                        release_dropped(*ident)
                    finally:
                        self._cond.acquire()
                    continue
                if lease._state != "held" and self._finished:
                    self._finished -= 1
                return lease

    def _run(self) -> None:
        while True:
            lease = self._next()
            if lease is None:
                return
            try:
                due = lease._renew_once()
            except Exception:  # a bug must not kill renewal of every other lease
                logger.exception("Renewal of lock %r failed unexpectedly", lease.name)
                due = time.monotonic() + 0.5
            if due is not None:
                with self._cond:
                    heapq.heappush(
                        self._heap, (due, next(self._seq), weakref.ref(lease), _ident(lease))
                    )


def _ident(lease: Lease) -> tuple[Any, str, str, dict[str, bool]]:
    # The dict is shared with the lease, which marks it when it ends.
    return (lease._backend, lease.name, lease.owner, lease._ended)


_renewers: dict[str, Renewer] = {}
_renewers_lock = threading.Lock()


def renewer(alias: str = "") -> Renewer:
    """The renewer of backend ``alias`` (one thread per backend, not per lease)."""
    found = _renewers.get(alias)
    if found is None:
        with _renewers_lock:
            found = _renewers.setdefault(alias, Renewer(alias))
    return found


def _reset_after_fork() -> None:
    _renewers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
