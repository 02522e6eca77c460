"""One event loop's waiters on one watch stream (:class:`_Hub`): every deletion under the
backend's lock and waiter keys, dispatched to the waiters of each key, and their waiter
leases renewed together. The stream itself is :meth:`.watch.EtcdWatches._watch_all_g`,
run by the asyncio driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from distlocks.backends.etcd.protocol import (
    _ENDED,
    _SEEN,
    WATCH_RETRY_FIRST,
    WATCH_RETRY_MAX,
    _int,
    _unb64,
)
from distlocks.exceptions import LockBackendUnavailable, LockError

#: The backend's one logger, whichever module logs.
logger = logging.getLogger("distlocks.backends.etcd")

if TYPE_CHECKING:
    from distlocks.backends.etcd.watch import EtcdWatches


#: A hub's wake-up when the waiter must read the queue again before it watches (its
#: revision is older than the hub's stream covers, or the history was compacted); and
#: when the waiter's own lease is gone.
_AGAIN, _GONE = "again", "gone"


@dataclasses.dataclass(eq=False)
class _Waiter:
    """One caller waiting, in a hub, for the deletion of a key after ``revision``."""

    future: asyncio.Future[str]
    revision: int
    #: Its waiter key's lease, renewed by the hub while it waits (0: none).
    lease: int


class _Hub:
    """One event loop's waiters share one watch stream: every deletion under the
    backend's lock and waiter keys (with the permit keys between them) from the
    revision the first waiter read, dispatched to the waiters of each key. So a loop
    needs one connection for any number of waiters, not one each. The stream runs
    while anyone waits, and is opened again from the last revision seen when it ends.

    A waiter registers with the revision it read its queue at: the deletions after it
    are either still to come on the stream, or among the ones seen already, which the
    hub remembers (the last :attr:`RECENT` keys). The waiters' own leases are renewed
    together, one request for all, every third of their length."""

    RECENT = 8192

    def __init__(self, backend: EtcdWatches) -> None:
        self.backend = backend
        self.waiters: dict[str, list[_Waiter]] = {}
        self.leases: dict[int, _Waiter] = {}
        #: Revision of the last deletion seen of each key (oldest first).
        self.recent: dict[str, int] = {}
        #: Every deletion after ``floor`` is in ``recent`` or still to come.
        self.floor = 0
        #: The revision the next stream starts at.
        self.resume = 0
        self.stream: asyncio.Task[None] | None = None
        self.renewer: asyncio.Task[None] | None = None
        #: The pause after streams that ended without a word (doubling), and when the
        #: next may open: kept across streams, which stop whenever nobody waits.
        self.pause = 0.0
        self.not_before = 0.0

    async def wait(self, key: str, revision: int, until: float, lease: int) -> str | bool:
        """:data:`_SEEN` once ``key`` is deleted after ``revision``, :data:`_AGAIN` (read
        the queue again, then wait), :data:`_GONE` (the waiter's lease ran out), False
        at ``until`` (monotonic); LockBackendUnavailable when no member serves."""
        loop = asyncio.get_running_loop()
        if self.stream is None:
            self.floor, self.resume = revision, revision + 1
            self.recent.clear()
            self.stream = loop.create_task(self._run())
        elif revision < self.floor:
            return _AGAIN
        seen = self.recent.get(key, 0)
        if seen > revision:
            return _SEEN
        waiter = _Waiter(loop.create_future(), revision, lease)
        self.waiters.setdefault(key, []).append(waiter)
        if lease:
            self.leases[lease] = waiter
            if self.renewer is None:
                self.renewer = loop.create_task(self._renew())
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                return await waiter.future
        except TimeoutError:
            return False
        finally:
            self._forget(key, waiter)

    def _forget(self, key: str, waiter: _Waiter) -> None:
        waiters = self.waiters.get(key, [])
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            self.waiters.pop(key, None)
        if waiter.lease and self.leases.get(waiter.lease) is waiter:
            del self.leases[waiter.lease]
        if not self.leases and self.renewer is not None:
            self.renewer.cancel()
            self.renewer = None
        if not self.waiters and self.stream is not None:
            # Nobody waits: the stream closes (its connection with it).
            self.stream.cancel()
            self.stream = None

    def _wake(self, waiter: _Waiter, outcome: str | BaseException) -> None:
        if waiter.future.done():
            return
        if isinstance(outcome, BaseException):
            waiter.future.set_exception(outcome)
        else:
            waiter.future.set_result(outcome)

    def _wake_all(self, outcome: str | BaseException) -> None:
        for waiters in list(self.waiters.values()):
            for waiter in waiters:
                self._wake(waiter, outcome)

    def deliver(self, events: list[dict[str, Any]]) -> None:
        """Deletions seen on the stream (in revision order)."""
        for event in events:
            kv = event.get("kv") or {}
            key = _unb64(kv.get("key")).decode(errors="replace")
            revision = _int(kv.get("mod_revision"))
            self.recent.pop(key, None)
            self.recent[key] = revision
            self.resume = max(self.resume, revision + 1)
            for waiter in self.waiters.get(key, ()):
                if revision > waiter.revision:
                    self._wake(waiter, _SEEN)
        while len(self.recent) > self.RECENT:
            oldest = next(iter(self.recent))
            self.floor = max(self.floor, self.recent.pop(oldest))

    async def _run(self) -> None:
        backend = self.backend
        try:
            while True:
                await asyncio.sleep(max(0.0, self.not_before - time.monotonic()))
                opened = time.monotonic()
                try:
                    outcome = await backend._arun(backend._watch_all_g(self.resume, self))
                except LockBackendUnavailable as exc:
                    if not getattr(exc, "election", False):
                        raise
                    outcome = _ENDED  # no member has a leader now: again, after a pause
                if isinstance(outcome, int):
                    # Compacted past the revision asked for: what was missed is unknown,
                    # so every waiter reads its queue again.
                    self.floor, self.resume = outcome - 1, outcome
                    self.recent.clear()
                    self._wake_all(_AGAIN)
                    continue
                # Ended without a word: it is opened again from the last revision seen,
                # after a pause (a member, or something in front of it, that ends every
                # stream must not make a busy loop); the waiters meanwhile read their
                # queues once more, so that a stream that never delivers strands none.
                if time.monotonic() - opened > WATCH_RETRY_MAX:
                    self.pause = 0.0  # it served a while: not one that ends at once
                self.pause = min(WATCH_RETRY_MAX, max(WATCH_RETRY_FIRST, self.pause * 2))
                self.not_before = time.monotonic() + self.pause
                self._wake_all(_AGAIN)
        except LockError as exc:
            self._wake_all(exc)
        finally:
            if self.stream is asyncio.current_task():
                self.stream = None

    async def _renew(self) -> None:
        backend = self.backend
        while True:
            await asyncio.sleep(max(0.2, backend.WAIT_TTL / 3))
            leases = list(self.leases)
            if not leases:
                continue
            try:
                left = await backend._arun(backend._keepalive_g(leases, "wait for", "*"))
            except LockError:
                # Retried at the next turn; a lease that runs out meanwhile only costs
                # its waiter its place.
                logger.debug("Could not renew the etcd waiters' leases", exc_info=True)
                continue
            for lease, seconds in zip(leases, left, strict=True):
                waiter = self.leases.get(lease)
                if seconds <= 0 and waiter is not None:
                    self._wake(waiter, _GONE)
