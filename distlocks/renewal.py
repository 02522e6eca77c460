"""The process-wide lease renewers: a few threads per backend, however many leases.

Leases are kept in a heap ordered by their next renewal time. A scheduling thread sleeps
until the earliest one is due, takes it together with every other lease due by then, and
hands the batch to a caller thread, which renews it (one ``extend_many`` call per
backend: on Redis one script per 500 leases, each lease still compare-and-expire on its
own) and schedules each lease again at a third of its ttl. The scheduler never waits for
a server: it also watches the deadlines of the leases whose renewal is waiting for a
caller or in flight, and reports a lease lost at its deadline while its call is stuck
(the lease's own state lock, not the mutex the caller holds through the call). A second
caller starts only when a batch is due while every caller is busy (at most
:data:`MAX_CALLERS`). The threads exit after a while with nothing to do and are started
again by the next lease, and they are rebuilt in a forked child (threads do not survive
``fork``).

The heap holds weak references: a lease that its holder dropped without
releasing is released at its next renewal time instead of being kept alive for
as long as the process runs. A lease that ended stays in the heap until its turn
comes (then it is dropped) or until the heap has doubled since it was last
compacted, whichever is first: ending a lease costs the renewer nothing.

The leases of ``alock()`` are renewed on their event loop instead, the same way: one
:class:`LoopRenewer` per loop, a heap and one pending timer of the loop for all of them;
a renewal turn adds an entry at the lease's deadline, looked at then.

Why this is one module of about 750 lines (issue 28's size rule): the thread renewer and
the loop renewer keep the same heap discipline (weak entries, compaction, deadline
watches, dropped leases), which must be read side by side.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distlocks.backends.base import BaseBackend
from distlocks.exceptions import LockError
from distlocks.lease import (
    EXTEND,
    FREE_LOST,
    HELD,
    RELEASE_RETRY,
    arelease_dropped,
    release_dropped,
)
from distlocks.notices import Crew, LossNotices, tell

if TYPE_CHECKING:
    from distlocks.lease import AsyncLease, BaseLease, Lease

logger = logging.getLogger(__name__)

#: Seconds the thread lingers with no lease before exiting.
IDLE_EXIT = 30.0
#: The heap is compacted when it reaches this size, or twice its size after the last
#: compaction: amortised O(1) per lease, and it never holds much more than twice the
#: leases not yet ended.
COMPACT_AT = 128
#: Leases due within this many seconds of the first due one are renewed with it.
COALESCE = 0.02
#: Most leases taken in one turn (a backend splits them into round trips of its own).
MAX_BATCH = 5000
#: Renewals whose lateness each renewer remembers (the most recent ones).
LATENESS_SAMPLES = 4096
#: Most threads making one backend's renewal calls at once. One does, as long as calls
#: return in time; another starts only when a batch waits while every caller is in a
#: call with no answer for CALLER_STUCK seconds.
MAX_CALLERS = 4
CALLER_STUCK = 0.25
#: Marks a heap entry that looks at a lease's deadline instead of renewing it.
WATCH = "watch"


class Renewer:
    """Renews the leases of one backend (so a hung server delays only its own leases).

    Two kinds of thread: one scheduler (``distlocks-renewer:<alias>``), which never
    waits for a server, and up to :data:`MAX_CALLERS` callers, which make the renewal
    calls. The scheduler hands each batch that is due to a caller and keeps an eye on
    the deadlines of the leases whose renewal is waiting for a caller or in flight: a
    lease whose deadline passes while its call is stuck is reported lost then, not when
    the call returns (the lease's own small state lock, never its mutex, which the
    caller holds through the call)."""

    def __init__(self, alias: str = "") -> None:
        self.alias = alias
        self._heap: list[Any] = []
        self._seq = itertools.count()
        # The condition's own lock, taken directly on the hot path (add), which saves
        # the condition's Python-level __enter__/__exit__.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the scheduler waits on it
        self._work = threading.Condition(self._lock)  # the callers wait on it
        self._thread: threading.Thread | None = None
        self._compact_at = COMPACT_AT
        # When the waiting scheduler wakes by itself (monotonic): a new lease due later
        # needs no wake-up. Only read and written under the condition.
        self._wake_at = math.inf
        # Batches handed to the callers, not yet taken: (key, leases, dropped idents).
        self._queue: collections.deque[tuple[int, list[Lease], list[Any]]] = collections.deque()
        # key -> [earliest deadline, leases, their deadlines in order (made when the
        # first one passes), how many of those were looked at] of each batch queued or
        # in flight.
        self._watched: dict[int, list[Any]] = {}
        self._callers = Crew()  # the threads making the calls
        # caller thread's id -> monotonic start of the call it is making.
        self._calls: dict[int, float] = {}
        #: Seconds by which recent renewals ran after they were due (see lateness()).
        self.late: collections.deque[float] = collections.deque(maxlen=LATENESS_SAMPLES)
        #: Renewal turns taken so far (a turn renews one lease or a batch).
        self.turns = 0
        # The losses the scheduler finds are told there, never on the scheduler: the
        # holder's on_lost may block (or wait for the mutex a stuck call holds).
        self._notices = LossNotices(alias)

    def add(self, lease: Lease, due: float) -> None:
        """Renew ``lease`` at monotonic time ``due`` (and after that as it asks)."""
        # The lease's identity (see _ident), inlined: this runs once per lease.
        entry = (
            due, next(self._seq), weakref.ref(lease),
            (lease._backend, lease.name, lease.owner, lease._ended),
        )  # fmt: skip
        with self._lock:
            if len(self._heap) >= self._compact_at:
                self._compact()
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._start()
            elif due < self._wake_at:
                # Wake the thread only if it now has to run sooner than planned.
                self._cond.notify()

    def watch(self, lease: BaseLease) -> None:
        """Look at ``lease`` at its current deadline, and report it lost then if it has
        not been renewed: for an extension whose call may get stuck."""
        deadline = lease._valid_until
        if deadline is None:
            return
        entry = (deadline, next(self._seq), weakref.ref(lease), _ident(lease), WATCH)
        with self._lock:
            if 0 < lease._watch_at <= deadline:
                return  # an entry already looks sooner, and looks again if still needed
            lease._watch_at = deadline
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._start()
            elif deadline < self._wake_at:
                self._cond.notify()

    def _start(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"distlocks-renewer:{self.alias}", daemon=True
        )
        # Recorded once started (it waits for this lock before doing anything): if it
        # cannot start, the next lease tries again.
        thread.start()
        self._thread = thread

    def _compact(self) -> None:
        """Drop the entries of leases that ended, released or lost, whether or not the
        lease object still exists (called with the condition held). Entries of leases
        dropped without a release stay: their turn releases them."""
        self._heap = [entry for entry in self._heap if not entry[3][3]["ended"]]
        heapq.heapify(self._heap)
        self._compact_at = max(COMPACT_AT, 2 * len(self._heap))

    # -- the scheduler ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # However the thread ends, the next lease added starts a new one.
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _loop(self) -> None:
        while True:
            step = self._next_step()
            if step is None:
                return
            batch, dropped, checks, watches = step
            if batch or dropped:
                self._hand_over(batch, dropped)
            lost: list[tuple[BaseLease, str]] = []
            for lease in checks:
                self._check_deadline(lease, lost)
            for lease, _ in watches:
                try:
                    if self._check_deadline(lease, lost) and lease._renewing:
                        self.watch(lease)  # renewed meanwhile, but a call is in flight
                except Exception:  # a bug must not stop the other leases' renewal
                    logger.exception("Deadline check of lock %r failed", lease.name)
            self._notices.post(lost)

    def _next_step(
        self,
    ) -> tuple[list[Lease], list[Any], list[BaseLease], list[tuple[BaseLease, float]]] | None:
        """Wait until a batch is due or a watched deadline passes; (the batch, the
        idents of leases dropped unreleased, the leases of batches in flight to check
        against their deadline, the watch entries due). None when idle long enough to
        exit."""
        idle_since = time.monotonic()
        with self._cond:
            while True:
                now = time.monotonic()
                checks = self._overdue(now)
                watches: list[tuple[BaseLease, float]] = []
                heap = self._heap
                if heap and heap[0][0] <= now:
                    batch, dropped = self._pop_due(now, watches)
                    if batch or dropped or checks or watches:
                        return batch, dropped, checks, watches
                    continue
                if checks:
                    return [], [], checks, []
                wake = min(heap[0][0] if heap else math.inf, self._more_callers(now))
                for watched in self._watched.values():
                    wake = min(wake, watched[0])
                if wake == math.inf:
                    if now - idle_since >= IDLE_EXIT:
                        self._thread = None
                        return None
                    wake = now + IDLE_EXIT
                else:
                    idle_since = now
                self._wake_at = wake
                self._cond.wait(wake - now)

    def _pop_due(
        self, now: float, watches: list[tuple[BaseLease, float]]
    ) -> tuple[list[Lease], list[Any]]:
        """Take every renewal due by now (or within :data:`COALESCE` seconds: renewing a
        little early costs nothing and saves a round trip); the watch entries due go to
        ``watches``. Called with the condition held."""
        heap = self._heap
        batch: list[Lease] = []
        dropped: list[Any] = []
        horizon = now + COALESCE
        first = True
        while heap and heap[0][0] <= horizon and len(batch) < MAX_BATCH:
            if len(heap[0]) > 4 and heap[0][0] > now:
                break  # a deadline is looked at when it has passed, never early
            entry = heapq.heappop(heap)
            ref, ident = entry[2], entry[3]
            if ident[3]["ended"]:
                continue  # released or lost: nothing to do
            lease = ref()
            if len(entry) > 4:  # a deadline to look at, not a renewal
                if lease is not None:
                    if lease._watch_at == entry[0]:
                        lease._watch_at = 0.0  # a watch() from now on adds an entry
                    watches.append((lease, entry[0]))
                continue
            if first:
                self.late.append(max(0.0, now - entry[0]))
                self.turns += 1
                first = False
            if lease is None:
                # Dropped by its holder without a release: nobody can release it now,
                # so a caller does it rather than renew it.
                dropped.append(ident)
            else:
                batch.append(lease)
        return batch, dropped

    def _overdue(self, now: float) -> list[BaseLease]:
        """The leases of the batches queued or in flight whose deadline has passed
        (called with the condition held). A batch still in flight at its first deadline
        has its deadlines sorted then, once, so each later one costs only its own look
        (a stuck batch of thousands of leases, all due around the same time, would
        otherwise be scanned whole at each of their deadlines)."""
        found: list[BaseLease] = []
        for watched in self._watched.values():
            if watched[0] > now:
                continue
            order = watched[2]
            if order is None:
                order = watched[2] = sorted(
                    (lease._valid_until, n, lease)
                    for n, lease in enumerate(watched[1])
                    if lease._valid_until is not None
                )
            looked = watched[3]
            while looked < len(order) and order[looked][0] <= now:
                found.append(order[looked][2])
                looked += 1
            watched[3] = looked
            watched[0] = order[looked][0] if looked < len(order) else math.inf
        return found

    @staticmethod
    def _check_deadline(lease: BaseLease, lost: list[tuple[BaseLease, str]]) -> bool:
        """Mark ``lease`` lost if its deadline passed (without its mutex), its notice
        added to ``lost``; True if it is still held."""
        try:
            reason = lease._lost_at_deadline()
        except Exception:  # a bug must not stop the other leases' renewal
            logger.exception("Deadline check of lock %r failed unexpectedly", lease.name)
            return False
        if reason is not None:
            lost.append((lease, reason))
            return False
        return lease._state == HELD and not lease._inherited()

    def _hand_over(self, batch: list[Lease], dropped: list[Any]) -> None:
        key = next(self._seq)
        with self._cond:
            self._queue.append((key, batch, dropped))
            if batch:
                self._watched[key] = [_earliest(batch), batch, None, 0]
            if self._callers.idle:
                self._work.notify()
            else:
                self._more_callers(time.monotonic())

    def _more_callers(self, now: float) -> float:
        """Start a caller if batches wait while every caller is in a call that has had
        no answer for :data:`CALLER_STUCK` seconds (a stuck connection must not hold up
        every other lease; a merely busy caller is waited for: callers sharing a loaded
        CPU would all finish later). Returns when to look again (inf: no need). Called
        with the condition held."""
        if not self._queue or self._callers.idle or self._callers.threads >= MAX_CALLERS:
            return math.inf
        calls = self._calls
        if len(calls) < self._callers.threads:
            return math.inf  # a caller is between two batches: it takes the next one
        youngest = max(calls.values(), default=-math.inf)
        if now - youngest < CALLER_STUCK:
            return youngest + CALLER_STUCK
        thread = threading.Thread(
            target=self._call, name=f"distlocks-renewal-calls:{self.alias}", daemon=True
        )
        thread.start()
        self._callers.threads += 1
        return math.inf

    # -- the callers -----------------------------------------------------------------

    def _call(self) -> None:
        counted = True
        me = id(threading.current_thread())
        try:
            while True:
                with self._cond:
                    if not self._callers.wait_for_work(self._work, self._queue):
                        counted = False
                        return
                    # Every batch waiting, in one call: batches queued behind a slow
                    # call are renewed together, as one thread renewing them would.
                    keys, batch, dropped = self._take_queued()
                    self._calls[me] = time.monotonic()
                try:
                    for ident in dropped:
                        try:
                            release_dropped(*ident)
                        except Exception:
                            logger.exception("Release of dropped lock %r failed", ident[1])
                    if len(batch) == 1:
                        self._renew_alone(batch[0])
                    elif batch:
                        self._renew_together(batch)
                finally:
                    with self._cond:
                        for key in keys:
                            self._watched.pop(key, None)
                        del self._calls[me]
        finally:
            if counted:  # ended by an error of its own
                with self._cond:
                    self._callers.threads -= 1

    def _take_queued(self) -> tuple[list[int], list[Lease], list[Any]]:
        """The batches queued, up to :data:`MAX_BATCH` leases (at least one batch),
        as one (called with the condition held)."""
        keys: list[int] = []
        batch: list[Lease] = []
        dropped: list[Any] = []
        queue = self._queue
        while queue and (not keys or len(batch) + len(queue[0][1]) <= MAX_BATCH):
            key, leases, idents = queue.popleft()
            keys.append(key)
            batch.extend(leases)
            dropped.extend(idents)
        return keys, batch, dropped

    def _schedule(self, lease: Lease, due: float | None) -> None:
        if due is not None:
            with self._cond:
                heapq.heappush(
                    self._heap, (due, next(self._seq), weakref.ref(lease), _ident(lease))
                )
                if due < self._wake_at:
                    self._cond.notify()

    def _renew_alone(self, lease: Lease) -> None:
        if not lease._mutex.acquire(blocking=False):
            # Its holder is extending or releasing it (perhaps stuck in that call): not
            # waited for, which would hold this caller up; looked at again soon, and at
            # its deadline at the latest.
            self._schedule(lease, _busy_retry(lease))
            return
        try:
            due = lease._renew_once()
        except Exception:  # a bug must not kill renewal of every other lease
            logger.exception("Renewal of lock %r failed unexpectedly", lease.name)
            due = time.monotonic() + 0.5
        except BaseException:
            # This caller dies with it (a greenlet killed, KeyboardInterrupt): the lease
            # is looked at again soon by another, as a batch's leases are.
            self._schedule(lease, time.monotonic() + 0.5)
            raise
        finally:
            lease._mutex.release()
        self._schedule(lease, due)

    def _renew_together(self, batch: list[Lease]) -> None:
        """Renew leases due at the same time with one ``extend_many`` call per backend.

        Each lease's mutex is held from its decision to the bookkeeping of the answer, as
        in :meth:`Lease._renew_once`, so a release cannot interleave. A lease whose mutex
        is busy (its holder is releasing or extending it) is looked at again soon."""
        # The losses found, told once every lease is recorded and its mutex free: the
        # holder's on_lost must not keep the others' answers unrecorded. Told here, on
        # this caller (as soon as can be after the loss is recorded): one that blocks
        # makes this call look stuck, and another caller takes the next batches.
        lost: list[tuple[BaseLease, str]] = []
        alone: list[Lease] = []
        try:
            self._renew_groups(batch, lost, alone)
        finally:
            for lease, reason in lost:
                tell(lease, reason)
        for lease in alone:  # not in a group's call: after it, each holding only its own
            self._renew_alone(lease)

    def _renew_groups(
        self, batch: list[Lease], lost: list[tuple[BaseLease, str]], alone: list[Lease]
    ) -> None:
        groups: dict[int, tuple[BaseBackend, list[Lease]]] = {}
        # The leases whose mutex this caller holds and whose answer is not recorded yet.
        unrecorded: dict[int, Lease] = {}
        try:
            for lease in batch:
                backend = lease._backend
                if not isinstance(backend, BaseBackend):
                    alone.append(lease)
                    continue
                if not lease._mutex.acquire(blocking=False):
                    self._schedule(lease, _busy_retry(lease))
                    continue
                unrecorded[id(lease)] = lease
                try:
                    step, when = lease._renew_step(lost)
                    if step == FREE_LOST:
                        backend.release_quietly(lease.name, lease.owner)
                except Exception:
                    del unrecorded[id(lease)]
                    lease._mutex.release()
                    logger.exception("Renewal of lock %r failed unexpectedly", lease.name)
                    self._schedule(lease, time.monotonic() + 0.5)
                    continue
                if step != EXTEND:
                    del unrecorded[id(lease)]
                    lease._mutex.release()
                    self._schedule(lease, when)
                    continue
                # Marked in flight from here on (the calls of other leases of the batch
                # come first), so that a release does not wait for this batch's call.
                lease._renewing = time.monotonic()
                if not lease._call_may_start():
                    del unrecorded[id(lease)]
                    lease._mutex.release()  # a release is under way: the lease is its
                    self._schedule(lease, time.monotonic() + RELEASE_RETRY)
                    continue
                groups.setdefault(id(backend), (backend, []))[1].append(lease)
            for backend, leases in groups.values():
                self._extend_group(backend, leases, lost, unrecorded)
        finally:
            # Left by a BaseException (KeyboardInterrupt, SystemExit, a greenlet killed)
            # out of extend_many or the bookkeeping: the mutexes are freed all the same,
            # or every later release or extend() of these leases would wait for ever;
            # they are looked at again soon (their call's answer is unknown).
            for lease in unrecorded.values():
                lease._renewing = 0.0
                lease._mutex.release()
            for lease in unrecorded.values():
                self._schedule(lease, _busy_retry(lease))

    def _extend_group(
        self,
        backend: BaseBackend,
        leases: list[Lease],
        lost: list[tuple[BaseLease, str]],
        unrecorded: dict[int, Lease],
    ) -> None:
        """One ``extend_many`` call for ``leases`` (their mutexes held), and the
        bookkeeping of each answer; each mutex is released (and the lease dropped from
        ``unrecorded``) once its answer is recorded."""
        started = time.monotonic()
        for lease in leases:
            lease._renewing = started
        outcomes: list[bool | LockError]
        try:
            outcomes = backend.extend_many([(x.name, x.owner, x.ttl) for x in leases])
            if len(outcomes) != len(leases):
                raise RuntimeError(f"{len(outcomes)} answers for {len(leases)} leases")
        except Exception as exc:  # a bug of a backend: report it on every lease
            logger.exception("Renewal of %d leases failed unexpectedly", len(leases))
            error = LockError(f"renewal failed: {type(exc).__name__}: {exc}")
            outcomes = [error] * len(leases)
        late: list[Lease] = []
        for lease, outcome in zip(leases, outcomes, strict=True):
            try:
                due = lease._renew_result(started, outcome, lost)
                if outcome is True and lease._give_back_late():
                    late.append(lease)
            except Exception:
                logger.exception("Renewal of lock %r failed unexpectedly", lease.name)
                due = time.monotonic() + 0.5
            finally:
                lease._renewing = 0.0
                del unrecorded[id(lease)]
                lease._mutex.release()
            self._schedule(lease, due)
        for lease in late:
            # Renewed after its deadline had reported it lost: given back.
            backend.release_quietly(lease.name, lease.owner)


def _earliest(leases: list[Lease]) -> float:
    """The earliest deadline of ``leases`` (inf: none has one)."""
    found = math.inf
    for lease in leases:
        deadline = lease._valid_until
        if deadline is not None and deadline < found:
            found = deadline
    return found


def _watched(lease: BaseLease) -> bool:
    """A watch entry of ``lease`` is due: report the loss if its deadline passed; True
    if it is still held with a call in flight (to be watched again, at its new
    deadline)."""
    return lease.held() and bool(lease._renewing)


def _busy_retry(lease: Lease) -> float:
    """When to look again at a lease whose mutex is busy: soon, and no later than its
    deadline while it lasts."""
    now = time.monotonic()
    due = now + max(0.05, lease.ttl / 10)
    deadline = lease._valid_until
    if deadline is not None and now < deadline < due:
        due = deadline
    return due


class LoopRenewer:
    """Renews the :class:`~distlocks.lease.AsyncLease` leases of one event loop: one
    heap and one pending timer of the loop for all of them, so taking a lease costs a
    push on the heap, and releasing it nothing (a timer or a task per lease would cost
    their creation and cancellation on every cycle, though most leases end before their
    first renewal). Each renewal turn runs as a task of its own, as before.

    Only the loop's thread touches it. It refers to its loop weakly (the loop refers to
    it through its pending timer), so a loop dropped unclosed is still collected. An
    ended lease stays in the heap until its turn or the next compaction, as in
    :class:`Renewer`; and as there, the heap refers to its leases weakly: a lease that
    its holder dropped without releasing is released at its turn (it was renewed for as
    long as the loop ran, its lock never free again)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        # (due, seq, lease, identity), and a fifth item, WATCH, for a deadline to look at.
        self._heap: list[Any] = []
        # The releases of dropped leases in flight (the loop keeps its tasks weakly).
        self._cleanups: set[asyncio.Task[None]] = set()
        self._seq = itertools.count()
        # The one timer of ours pending on the loop, and when it fires (inf: none). A
        # lease due sooner replaces it (cancelled: a timer left behind would set one of
        # its own when it fires, and the loop would hold one more per such lease). Weakly:
        # a handle refers to its loop, which this renewer must not keep alive.
        self._timer: Callable[[], asyncio.TimerHandle | None] = _dead
        self._timer_at = math.inf
        self._compact_at = COMPACT_AT

    def add(self, lease: AsyncLease, due: float) -> None:
        """Renew ``lease`` at monotonic time ``due``; called on the loop's thread."""
        heap = self._heap
        if len(heap) >= self._compact_at:
            self._heap = heap = [entry for entry in heap if not entry[3][3]["ended"]]
            heapq.heapify(heap)
            self._compact_at = max(COMPACT_AT, 2 * len(heap))
        # The lease's identity (see _ident) is kept to release it if it is dropped.
        ident = (lease._backend, lease.name, lease.owner, lease._ended)
        heapq.heappush(heap, (due, next(self._seq), weakref.ref(lease), ident))
        if due < self._timer_at:
            self._set_timer(due)

    def watch(self, lease: AsyncLease) -> None:
        """Look at ``lease`` at its current deadline, and report it lost then if it has
        not been renewed by then: its renewal task, or its holder's ``extend()``, may be
        stuck awaiting the server. One heap entry, no timer of its own."""
        deadline = lease._valid_until
        if deadline is None or 0 < lease._watch_at <= deadline:
            return  # none, or an entry already looks sooner (and again if still needed)
        lease._watch_at = deadline
        entry = (deadline, next(self._seq), weakref.ref(lease), _ident(lease), WATCH)
        heapq.heappush(self._heap, entry)
        if deadline < self._timer_at:
            self._set_timer(deadline)

    def _set_timer(self, due: float) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        pending = self._timer()
        if pending is not None:
            pending.cancel()
        self._timer_at = due
        self._timer = weakref.ref(loop.call_later(max(0.0, due - time.monotonic()), self._fire))

    def _fire(self) -> None:
        """A timer went off: start the turns of the leases due (within COALESCE)."""
        self._timer = _dead
        self._timer_at = math.inf
        heap = self._heap
        passed = time.monotonic()
        now = passed + COALESCE
        while heap and heap[0][0] <= now:
            if len(heap[0]) > 4 and heap[0][0] > passed:
                break  # a deadline is looked at when it has passed, never early
            entry = heapq.heappop(heap)
            ref, ident = entry[2], entry[3]
            if ident[3]["ended"]:
                continue
            lease = ref()
            try:
                if len(entry) > 4:  # a deadline to look at
                    if lease is not None and lease._watch_at == entry[0]:
                        lease._watch_at = 0.0
                    if lease is not None and _watched(lease):
                        self.watch(lease)  # renewed meanwhile, but a call is in flight
                elif lease is None:
                    # Dropped by its holder without a release: nobody can release it
                    # now, so do it here rather than renew it.
                    task = asyncio.get_running_loop().create_task(arelease_dropped(*ident))
                    self._cleanups.add(task)
                    task.add_done_callback(self._cleanups.discard)
                else:
                    lease._renewal_turn(self)
            except Exception:  # one lease's bug must not stop the others' renewal
                logger.exception("Renewal of lock %r failed unexpectedly", ident[1])
        if heap:
            self._set_timer(heap[0][0])


_loop_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopRenewer] = (
    weakref.WeakKeyDictionary()
)
_loop_renewers_lock = threading.Lock()


def loop_renewer(loop: asyncio.AbstractEventLoop) -> LoopRenewer:
    """The renewer of the asyncio leases of ``loop`` (call it on the loop's thread)."""
    last = _last_loop
    if last[0]() is loop:
        found = last[1]()
        if found is not None:
            return found
    return _find_loop_renewer(loop)


def _find_loop_renewer(loop: asyncio.AbstractEventLoop) -> LoopRenewer:
    global _last_loop
    with _loop_renewers_lock:  # loops of other threads may look up at the same time
        found = _loop_renewers.get(loop)
        if found is None:
            found = _loop_renewers[loop] = LoopRenewer(loop)
    # The last loop asked about and its renewer: most processes run one loop at a time.
    # Both weakly: a renewer lives as long as its loop, and no longer.
    _last_loop = (weakref.ref(loop), weakref.ref(found))
    return found


def _dead() -> None:
    return None


#: (weak references to the last loop looked up and to its renewer).
_last_loop: tuple[Callable[[], object], Callable[[], LoopRenewer | None]] = (_dead, _dead)


def lateness() -> dict[str, dict[str, float]]:
    """How late renewals ran against their schedule, per backend alias: the median and
    99th percentile in seconds of the most recent ones (of each turn's first lease, the
    one that waited longest), and how many turns were taken. A renewal due at a third of
    the ttl that runs late by more than the other two thirds is a lost lease."""
    found = {}
    for alias, renewer_ in list(_renewers.items()):
        samples = sorted(renewer_.late)
        if not samples:
            continue
        found[alias] = {
            "p50": samples[len(samples) // 2],
            "p99": samples[min(len(samples) - 1, (len(samples) * 99) // 100)],
            "turns": float(renewer_.turns),
        }
    return found


def _ident(lease: BaseLease) -> tuple[Any, str, str, dict[str, Any]]:
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
    global _loop_renewers_lock
    _renewers.clear()
    # A forked child runs none of its parent's loops; the guard may have been held.
    _loop_renewers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
