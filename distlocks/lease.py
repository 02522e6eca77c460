"""A held lock: :class:`Lease` (threads) and :class:`AsyncLease` (asyncio).

A lease is the holder's side of a lock. It knows, without asking the server,
until when it is certainly valid (a monotonic deadline taken *before* the
acquire request was sent, so it errs on the safe side), and it reports loudly
when it has been lost: ``held()`` turns False, ``ensure_held()`` raises
:class:`~distlocks.exceptions.LockLost`, the ``lock_lost`` signal fires and the
``on_lost`` callback runs, exactly once.

A :class:`Lease` released while a connection of its thread is inside
``transaction.atomic()`` stays held (and renewed) until that transaction commits
or rolls back (:mod:`distlocks.transactions`), unless ``release_on_commit`` is off.

With ``auto_renew`` the lease is extended at about a third of its ttl, by the
process-wide :mod:`distlocks.renewal` thread for :class:`Lease` and, for
:class:`AsyncLease`, on the loop that took it (one renewer per loop, each renewal turn an
asyncio task: :class:`distlocks.renewal.LoopRenewer`). A renewal that finds the lease
gone, or that cannot reach the server before the lease runs out, marks it lost; so does
the renewer at the lease's deadline while a renewal or ``extend()`` call is still
waiting for its answer (a late answer, even a success, leaves the lease lost).

A release never waits for a renewal's (or an extension's) call in flight, which a server
that does not answer leaves stuck until its socket timeout: the release is decided and
sent beside it, and the call's late answer changes nothing (see ``Lease._release``). Nor
does it wait for another release's call: of releases racing in any order, one sends its
call and none reports a loss that did not happen. A reentrant lock taken again while a
renewal's call is in flight is granted from local state (that call is confirming it).

Why this is one module of about 1000 lines (issue 28's size rule): the two lease classes
share one state machine (held, lost, released, given back at commit), and the rules of
each transition must be read side by side for the thread and the asyncio holder.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distlocks import process, signals, transactions
from distlocks.conf import conf
from distlocks.exceptions import LockError, LockLost
from distlocks.reentrancy import forget
from distlocks.validation import validate_ttl

if TYPE_CHECKING:
    from distlocks.backends.base import LeaseServer
    from distlocks.renewal import LoopRenewer

logger = logging.getLogger(__name__)

HELD = "held"
RELEASED = "released"
LOST = "lost"

# Steps of a release or renewal (see BaseLease._release_step / _renew_step).
RELEASE = "release"
EXTEND = "extend"
FREE_LOST = "free-lost"
NOTHING = "nothing"
#: The release waits for the end of the caller's transaction.
DEFER = "defer"

#: Renew when this fraction of the ttl has passed.
RENEW_FRACTION = 1 / 3
#: Seconds after which a renewal that gave way to a release looks again (the release
#: may leave the lease held: the inner release of a reentrant lease).
RELEASE_RETRY = 0.05

#: Losses found but not yet told: (lease, reason) pairs (see BaseLease._still_held).
Lost = list[tuple["BaseLease", str]]


class BaseLease:
    """State shared by the sync and async leases: validity, loss, reentrancy depth."""

    # The state every lease starts in, read from the class until first changed (an
    # assignment gives the lease its own): not copied into each lease at its creation.
    #: Successful extensions so far (by the watchdog or by ``extend()``).
    renewals = 0
    # The release waiting for the caller's transaction, if any.
    _deferral: transactions.Deferral | None = None
    _state = HELD
    _lost_reason = ""
    _last_renew_error = ""
    _release_requested = False
    # How many releases (or re-entries) found the mutex busy and wait for it, marked (see
    # Lease._beside_a_call): a renewal that has not sent its call yet leaves the lease to
    # them. Changed under the state lock only.
    _releasing = 0
    # A release decided to send its call (claimed in _release_step, under the state
    # lock) and has not had its answer yet: any other release meanwhile, with the mutex
    # or beside a call in flight, sends nothing.
    _unlocking = False
    _freed_on_server = False
    _depth = 1
    # Monotonic start of the renewal or extension whose server call is in flight (0:
    # none): a deadline passing meanwhile is reported as a renewal with no answer.
    _renewing = 0.0
    # Deadline at which a renewer will look at this lease (0: none pending), so that
    # repeated extend() calls keep one watch entry, not one each.
    _watch_at = 0.0

    def __init__(
        self,
        *,
        backend: LeaseServer,
        name: str,
        owner: str,
        fencing_token: int,
        ttl: float,
        started: float,
        remaining: float | None,
        on_lost: Callable[[Any], object] | None = None,
        auto_renew: bool = True,
        max_hold: float | None = None,
        release_on_commit: bool | None = None,
    ) -> None:
        self._backend = backend
        #: The lock name.
        self.name = name
        #: The backend alias (a key of ``DISTLOCKS_BACKENDS``).
        self.backend = backend.alias
        #: Random id of this acquisition; release and extend check it on the server.
        self.owner = owner
        #: Strictly increasing per lock name; send it with every write.
        self.fencing_token = fencing_token
        #: Lease length in seconds (the last one asked for).
        self.ttl = ttl
        # Wall-clock time of the acquisition, as the seconds time.time() gives: the
        # datetime ``acquired_at`` shows is built when asked, which most holders never do.
        now = time.time()
        self._acquired_wall = now
        # (wall-clock start, seconds) of the current term; ``expires_at`` adds them up
        # when asked.
        self._term: tuple[float, float] | None = None if remaining is None else (now, remaining)
        self.on_lost = on_lost
        self.auto_renew = auto_renew
        #: Stop renewing once the lease has been held this long (seconds), if set.
        self.max_hold = max_hold
        #: Whether a release inside ``transaction.atomic()`` waits for its end (None:
        #: the ``DISTLOCKS_RELEASE_ON_COMMIT`` setting).
        self.release_on_commit = release_on_commit
        self._started = started
        self._valid_until = None if remaining is None else started + remaining
        # The state that starts the same for every lease (held, depth 1, no deferral,
        # no renewal yet...) starts as the class attributes below.
        # Shared with the renewer and the drop guard, which hold no reference to the
        # lease: whether it ended, and the process it belongs to.
        self._ended: dict[str, Any] = {"ended": False, "pid": process.pid}
        # Serialises release, extension and renewal (held across their server call).
        self._mutex = threading.RLock()
        # Guards the state change to lost alone, never held across I/O, so held()
        # never waits for a renewal in flight.
        self._state_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r} backend={self.backend!r} "
            f"token={self.fencing_token} state={self.state}>"
        )

    @property
    def acquired_at(self) -> dt.datetime:
        """Wall-clock time of the acquisition (for display; deadlines use the monotonic
        clock)."""
        return dt.datetime.fromtimestamp(self._acquired_wall, dt.UTC)

    @property
    def expires_at(self) -> dt.datetime | None:
        """Wall-clock end of the lease, or None where the backend has no expiry."""
        term = self._term
        if term is None:
            return None
        return dt.datetime.fromtimestamp(term[0], dt.UTC) + dt.timedelta(seconds=term[1])

    @property
    def state(self) -> str:
        """``"held"``, ``"released"`` or ``"lost"`` (local knowledge)."""
        self.held()
        return self._state

    @property
    def lost_reason(self) -> str:
        return self._lost_reason

    @property
    def release_pending(self) -> bool:
        """True while a release waits for the transaction it was asked in to end (the
        lease is still held, and renewed, until then)."""
        return self._deferral is not None

    @property
    def kind(self) -> str:
        """``"lock"``, or the permit's kind: ``"semaphore"``, ``"read"`` or ``"write"``."""
        return str(getattr(self._backend, "kind", "lock"))

    def remaining(self) -> float | None:
        """Seconds the lease is certainly still valid for, by the local monotonic clock."""
        if self._valid_until is None:
            return None
        return max(0.0, self._valid_until - time.monotonic())

    def held(self) -> bool:
        """True while the lease is known to be valid. Local knowledge only, no I/O, and
        it never waits for a renewal in flight. False in a process forked from the
        holder's: the lock belongs to the process that acquired it."""
        if self._state != HELD or self._inherited():
            return False
        if self._valid_until is not None and (now := time.monotonic()) >= self._valid_until:
            self._mark_lost(self._ran_out(now))
            return False
        return True

    def _ran_out(self, now: float) -> str:
        """Why a lease whose deadline has passed is lost."""
        sent = self._renewing
        if sent:
            reason = (
                f"its {self.ttl:g}s lease ran out while its renewal, sent "
                f"{now - sent:.1f}s earlier, still had no answer from the server"
            )
        else:
            reason = f"its {self.ttl:g}s lease ran out without being renewed"
        if self._last_renew_error:
            reason += f" (last renewal error: {self._last_renew_error})"
        return reason

    def _lost_at_deadline(self) -> str | None:
        """:meth:`held` for a renewer's scheduler: a lease whose deadline passed is
        marked lost, but the notice (log, signal, ``on_lost``) is left to the caller,
        which has it run elsewhere: the holder's code must not hold up the scheduler.
        Returns the reason when this call marked it lost."""
        if self._state != HELD or self._inherited() or self._valid_until is None:
            return None
        now = time.monotonic()
        if now < self._valid_until:
            return None
        reason = self._ran_out(now)
        return reason if self._end_lost(reason) else None

    def _inherited(self) -> bool:
        """True in a process forked from the one that acquired the lease."""
        return self._ended["pid"] != process.pid

    def _inherited_error(self) -> LockLost:
        return LockLost(
            self,  # type: ignore[arg-type]
            f"this lease belongs to process {self._ended['pid']}; a process forked from it "
            f"(here, {os.getpid()}) cannot use, extend or release it. Acquire the lock in "
            f"the child if it needs one",
        )

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` if the lease is known to be lost (or was released),
        or if this process did not acquire it (a forked child)."""
        if self._inherited():
            raise self._inherited_error()
        if not self.held():
            if self._state == RELEASED:
                raise LockLost(self, "it was already released")  # type: ignore[arg-type]
            raise LockLost(self, self._lost_reason)  # type: ignore[arg-type]

    def claim(self, *targets: Any) -> Any:
        """Write this lease's fencing token into the rows the holder will change, before
        reading them: a paused earlier holder's later write to them is then refused.
        See :func:`distlocks.claims.claim`."""
        from distlocks.claims import claim

        return claim(self, *targets)

    def _mark_lost(self, reason: str) -> None:
        """Record the loss once: log, signal, callback. Never raises."""
        if self._end_lost(reason):
            self._notify_lost(reason)

    def _end_lost(self, reason: str) -> bool:
        """The lease becomes lost, if it was held: True when this call did it. Runs
        none of the holder's code (the notice is :meth:`_notify_lost`)."""
        with self._state_lock:
            if self._state != HELD:
                return False
            self._state = LOST
            self._lost_reason = reason
        self._on_finished()
        return True

    def _notify_lost(self, reason: str) -> None:
        """Tell of the loss that :meth:`_end_lost` recorded: log, signal, callback (once,
        as only the call that ended the lease calls this). Never raises."""
        logger.warning(
            "Lost lock %r on backend %r (fencing token %s): %s",
            self.name, self.backend, self.fencing_token, reason,
        )  # fmt: skip
        signals.lock_lost.send_robust(sender=type(self), lease=self, reason=reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("on_lost callback for lock %r raised", self.name)

    def _on_finished(self) -> None:
        """Hook run once when the lease ends (released or lost).

        The renewer needs no word: it drops ended leases when it meets them (at their
        next turn, or when it compacts its heap)."""
        self._ended["ended"] = True
        forget(self)

    # -- release, renewal and extension, split into the decision (here), the
    # server call (blocking in Lease, awaited in AsyncLease) and the bookkeeping of
    # its answer (here), so both flavours follow exactly the same rules.

    def _release_step(self, deferrable: bool = False, locked: bool = False) -> str:
        """What a release must do: ``RELEASE``, ``DEFER`` (only when ``deferrable``),
        ``FREE_LOST`` or ``NOTHING``. ``locked``: the caller holds the mutex.

        Decided in one step (:meth:`_claim`), whether the release holds the mutex or is
        decided beside a call in flight (see Lease._release): two releases racing (one
        beside a renewal, one taking the mutex the moment that renewal ends) never both
        send their call, nor both take one level of a reentrant lease. A ``RELEASE``
        leaves ``_unlocking`` set: the caller clears it if its call fails (a retry may
        send it again)."""
        if self._ended["pid"] != process.pid:  # _inherited(), inlined: on every release
            # A forked child: the lock is its parent's, still held there.
            logger.debug("Not releasing lock %r: it belongs to the parent process", self.name)
            return NOTHING
        valid_until = self._valid_until
        if valid_until is not None and self._state == HELD and time.monotonic() >= valid_until:
            self.held()  # marks the lease that ran out lost (outside the state lock)
        if locked and not self._releasing:
            # The usual release: the mutex held and no release (or re-entry) counted as
            # waiting or beside a call. Nothing else decides meanwhile: a release coming
            # now is counted before it looks for a call, finds none (this one holds the
            # mutex), and waits for the mutex or for _unlocking. No state lock needed.
            step = self._claim()
        else:
            with self._state_lock:
                step = self._claim()
        if step != RELEASE:
            return step
        if deferrable:
            try:
                deferred = self._defer_release()
            except BaseException:
                self._unlocking = False
                raise
            if deferred:
                self._unlocking = False
                return DEFER
        self._release_requested = True
        return RELEASE

    def _claim(self) -> str:
        """The decision of :meth:`_release_step` (``RELEASE`` meaning: send it, unless
        it is deferred), with nothing else deciding meanwhile."""
        state = self._state
        if state == LOST:
            # Lost locally, but the server may still keep something (a Redis key not
            # yet expired, a pinned PostgreSQL connection): give it back once.
            # Ownership is checked there, so a newer holder is never touched.
            if self._freed_on_server:
                return NOTHING
            self._freed_on_server = True
            return FREE_LOST
        if state != HELD or self._unlocking:
            # Ended, or another release's call is under way: only one release sends
            # its call.
            return NOTHING
        if self._depth > 1:
            self._depth -= 1
            return NOTHING
        if self._deferral is not None:
            return NOTHING  # already waits for its transaction
        self._unlocking = True
        return RELEASE

    def _release_failed(self) -> None:
        """The call of a ``RELEASE`` step raised: the lease is left to a retry."""
        self._unlocking = False

    def _defer_release(self) -> bool:
        """Inside ``transaction.atomic()``: keep the lock until the transaction ends,
        so that the next holder reads what this one committed. Cheap when no
        connection of this thread is in an atomic block (the usual release)."""
        if self.release_on_commit is False:
            return False
        conns = transactions.open_transactions()
        if not conns:
            return False
        if self.release_on_commit is None and not conf.RELEASE_ON_COMMIT:
            return False
        if getattr(self._backend, "ends_with_transaction", False):
            # PostgreSQL's transaction mode: the lock already ends with the transaction.
            return False
        self._deferral = transactions.defer(self, conns)  # type: ignore[arg-type]
        return True

    def _cancel_deferred_release(self) -> bool:
        """Hold the lease again for a new acquisition by its thread, if its release
        waits for a transaction and it is still held; True when it did. Under the state
        lock alone, never the mutex: a renewal stuck in its call holds that one."""
        deferral = self._deferral
        if deferral is None or not self.held():
            return False
        with self._state_lock:  # against _release_deferred, which takes only this
            if self._deferral is not deferral:
                return False
            self._deferral = None
        transactions.forget(deferral)
        return True

    def _enter_again(self) -> None:
        """One more level of a reentrant lease, for its holder re-entering it, from local
        state: the caller has confirmed it with the server or found a call in flight
        that does (see distlocks.locks). A release waiting for the transaction is called
        off instead: the lease is held again by one holder, as before it."""
        if self._cancel_deferred_release():
            return
        with self._state_lock:  # against a release deciding beside a call in flight
            if self._state != HELD or self._unlocking:
                raise LockLost(self, "it was released while it was re-entered")  # type: ignore[arg-type]
            self._depth += 1

    def _released(self, freed: bool) -> bool:
        self._freed_on_server = True
        if not freed:
            self._mark_lost("the server no longer had it at release")
            return False
        self._set_released()
        return True

    def _set_released(self) -> None:
        with self._state_lock:
            if self._state == HELD:  # a loss noticed meanwhile stays reported
                self._state = RELEASED

    def _renew_step(self, lost: Lost | None = None) -> tuple[str, float | None]:
        """What a renewal must do (``EXTEND``, ``FREE_LOST`` or ``NOTHING``) and, if
        nothing, when to look again (None: never). A loss found here is told at once,
        or with ``lost``, added to it (see :meth:`_still_held`)."""
        if self._inherited():
            return NOTHING, None
        if self._renewal_allowed(lost):
            return EXTEND, None
        remaining = self.remaining() if self._state == HELD else None
        if remaining and not self._release_requested:
            # Past max_hold: wake once more at the deadline to report the loss.
            return NOTHING, time.monotonic() + remaining
        if self._state == LOST and not self._freed_on_server:
            self._freed_on_server = True
            return FREE_LOST, None
        return NOTHING, None

    def _renew_result(
        self, started: float, outcome: bool | LockError, lost: Lost | None = None
    ) -> float | None:
        """Record a renewal's answer; returns when to renew next (None: stop). After a
        success, the caller asks :meth:`_give_back_late` whether the answer came too late.
        A loss is told at once or, with ``lost``, added to it (see :meth:`_still_held`)."""
        if self._release_requested:
            # Released while the call was in flight (the release does not wait for it:
            # see Lease._release). Its answer changes nothing: the release, owner-checked
            # on the server, decides; a "not held" here is the release's own doing.
            self._renewing = 0.0
            return None
        if isinstance(outcome, LockError):
            self._renewing = 0.0
            return self._renewal_failed(outcome, lost)
        if not outcome:
            self._renewing = 0.0
            reason = "the server no longer had it at renewal (expired, deleted or force-released)"
            if lost is None:
                self._mark_lost(reason)
            elif self._end_lost(reason):
                lost.append((self, reason))
            self._freed_on_server = True
            return None
        # Checked while still in flight: a deadline that passed before this answer was
        # recorded is reported as a renewal with no answer in time.
        held = self._still_held(lost)
        self._renewing = 0.0
        if not held:
            # The loss has been reported (another holder may have been let in): the
            # lease stays lost.
            return None
        self._renewed(started, self.ttl)
        if self._state != HELD:
            return None  # the deadline's notice came between the check and the record
        return self._renewal_due()

    def _give_back_late(self) -> bool:
        """After a successful renewal or extension: True, once, when the lease was found
        lost while the call was in flight, so what the server has just extended must be
        given back (quietly, owner-checked) rather than left until it expires."""
        with self._state_lock:  # against a release beside the call, which may claim it
            if self._state == LOST and not self._freed_on_server:
                self._freed_on_server = True
                return True
        return False

    def _extended(self, started: float, ttl: float, ok: bool) -> None:
        if self._release_requested:
            # Released by another thread while this call was in flight: not a loss.
            self._renewing = 0.0
            raise LockLost(self, "it was released while this extension was in flight")  # type: ignore[arg-type]
        held = ok and self.held()  # while still in flight, as in _renew_result
        self._renewing = 0.0
        if not ok:
            self._mark_lost("the server no longer had it when it was extended")
            raise LockLost(self, self._lost_reason)  # type: ignore[arg-type]
        if held:
            self._renewed(started, ttl)
            if self._state == HELD:
                return
        # The deadline passed while the call was in flight: reported lost, and stays so.
        raise LockLost(self, self._lost_reason)  # type: ignore[arg-type]

    # -- renewal bookkeeping, shared by both flavours ---------------------------

    def _renewal_due(self) -> float | None:
        """Monotonic time of the next renewal, or None when it should stop."""
        if not self.auto_renew or self._valid_until is None:
            return None
        # Within the span the lease is trusted locally, which a backend may cap below
        # the ttl (a ZooKeeper session shorter than the ttl): renewed in time either way.
        return time.monotonic() + self._backend.local_lease(self.ttl) * RENEW_FRACTION

    def _still_held(self, lost: Lost | None) -> bool:
        """:meth:`held`; with ``lost``, a loss found is added to it instead of being told
        here: a renewer renewing a batch tells the losses once every lease of the batch
        is recorded and its mutex free, so that the holder's code (``on_lost``) cannot
        hold up the others' answers until their deadlines pass."""
        if lost is None:
            return self.held()
        reason = self._lost_at_deadline()
        if reason is not None:
            lost.append((self, reason))
            return False
        return self._state == HELD and not self._inherited()

    def _renewal_allowed(self, lost: Lost | None = None) -> bool:
        if self._state != HELD or self._release_requested or not self._still_held(lost):
            return False
        if self.max_hold is not None and time.monotonic() - self._started >= self.max_hold:
            if not self._last_renew_error:
                self._last_renew_error = f"renewal stopped: max_hold={self.max_hold:g}s reached"
                logger.warning(
                    "Lock %r reached max_hold=%ss; it is no longer renewed and will expire",
                    self.name, self.max_hold,
                )  # fmt: skip
            return False
        return True

    def _renewal_failed(self, exc: Exception, lost: Lost | None = None) -> float | None:
        """A renewal could not reach the server: retry soon, while the lease lasts."""
        self._last_renew_error = f"{type(exc).__name__}: {exc}"
        logger.warning("Could not renew lock %r: %s", self.name, self._last_renew_error)
        remaining = self.remaining()
        if remaining is None or remaining <= 0:
            self._still_held(lost)  # marks it lost, with the error as the reason
            return None
        # Retry quickly, and wake once more right at the deadline to report the loss.
        return time.monotonic() + min(max(0.05, self.ttl / 10), remaining)

    def _renewed(self, started: float, ttl: float) -> None:
        self.ttl = ttl
        self.renewals += 1
        self._last_renew_error = ""
        if self._valid_until is not None:  # a lease with a deadline gets a new one
            self._valid_until = started + self._backend.local_lease(ttl)
            self._term = (time.time(), ttl)


class Lease(BaseLease):
    """One acquisition of one lock, by one owner (blocking API)."""

    def extend(self, ttl: float | None = None) -> None:
        """Reset the lease to ``ttl`` seconds from now (default: the current ttl).

        Raises :class:`LockLost` if the server no longer has this lease.
        """
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        if not self._inherited():
            self._give_back_if_lost()
        self.ensure_held()  # before waiting for the mutex: a child must not wait for it
        with self._mutex:
            self.ensure_held()
            # Told at the deadline even if the call below is stuck (renewal imports this
            # module: imported here).
            from distlocks.renewal import renewer

            renewer(self.backend).watch(self)
            self._renewing = started = time.monotonic()
            try:
                ok = self._backend.extend(self.name, self.owner, ttl)
            except BaseException:
                self._renewing = 0.0
                raise
            try:
                self._extended(started, ttl, ok)
            except LockLost:
                if ok and self._give_back_late():
                    self._backend.release_quietly(self.name, self.owner)
                raise

    def _reenter(self) -> None:
        """Its holder re-enters this reentrant lease: confirmed with the server (a lease
        lost under the outer block fails loudly: :class:`LockLost`), except while a
        renewal's or an extension's call is in flight, which is confirming it: then
        granted from local state (``held()``), without waiting for that call, which a
        server that does not answer leaves stuck until its socket timeout. Its answer,
        if it says the lock is gone, is reported as any renewal's."""
        self.ensure_held()
        mutex = self._mutex
        if mutex.acquire(False) or not self._beside_a_call():
            try:
                self.extend()
                self._enter_again()
            finally:
                mutex.release()
        else:
            try:
                self.ensure_held()
                self._enter_again()
            finally:
                self._decided()

    def _give_back_if_lost(self) -> None:
        """A lease found lost here (it ran out locally) is given back on the server once,
        as the renewer would: what the server may still keep of it (a ZooKeeper node
        whose session lives on, a pinned PostgreSQL connection) must not keep others
        out. Ownership is checked there, so a newer holder is never touched."""
        self.held()  # notices a lease that ran out
        if self._state != LOST or self._freed_on_server:
            return
        with self._mutex:
            if self._freed_on_server:
                return
            self._freed_on_server = True
            self._backend.release_quietly(self.name, self.owner)

    def release(self) -> bool:
        """Free the lock if this lease still holds it.

        Idempotent: returns True when this call freed the lock, False when the lease
        had already been released or lost (a loss found here is reported as lost),
        or, for a reentrant lease, when an outer holder still holds it.

        Inside ``transaction.atomic()`` (on any database alias this thread uses), the
        lock is freed only when the transaction commits or rolls back: this call
        returns True (the release is accepted; calls made before the transaction
        ends return False, as for a lease already released), the lease stays held
        and renewed meanwhile (``release_pending`` is True), and the
        ``lock_released`` signal fires at the real release. Off with
        ``release_on_commit=False`` or ``DISTLOCKS_RELEASE_ON_COMMIT = False``.
        Raises :class:`~distlocks.exceptions.LockBackendUnavailable` if the server
        cannot be reached; the lease then ends by expiry.
        """
        return self._release(deferrable=True)

    def _release(self, deferrable: bool) -> bool:
        if self._ended["pid"] != process.pid:  # _inherited(), inlined: on every release
            # A forked child: the lock is its parent's, still held there. Checked before
            # the mutex, which a thread of the parent may have held at the fork.
            return False
        mutex = self._mutex
        # Without the mutex when a renewal's or an extension's call is in flight: the
        # release is decided and sent beside it (see _beside_a_call).
        locked = mutex.acquire(False) or not self._beside_a_call()
        try:
            if locked:
                step = self._release_step(deferrable, locked=True)
            else:
                try:
                    step = self._release_step(deferrable)
                finally:
                    self._decided()
            if step == DEFER:
                return True  # accepted: the transaction's end frees it
            if step == FREE_LOST:
                self._backend.release_quietly(self.name, self.owner)
            if step != RELEASE:
                return False
            try:
                freed = self._backend.release(self.name, self.owner)
            except BaseException:
                self._release_failed()
                raise
            if not self._released(freed):
                return False
        finally:
            if locked:
                mutex.release()
        self._on_finished()
        if signals.lock_released.receivers:  # skips building the arguments of a no-op
            signals.lock_released.send(sender=Lease, lease=self)
        return True

    def _beside_a_call(self) -> bool:
        """Called by a release (or a re-entry) that found the mutex busy: True when a
        renewal's or an extension's server call is in flight, which it must not wait for
        (the server may never answer it: the call lasts until its socket timeout, and the
        holder's ``with`` block would hang behind a background renewal); it stays counted
        in ``_releasing`` until it has decided, and then calls :meth:`_decided`.
        Otherwise False, once it holds the mutex: another release's call, or a call
        about to start.

        The release marks itself (``_releasing``) before it looks for a call, and a
        renewal marks itself (``_renewing``) before it looks for a release: whichever
        comes second sees the other (see :meth:`_call_may_start`), and a renewal seeing
        a release coming sends nothing. The holder's own ``extend()`` does not give way
        (it is the holder's call, which must not fail for a reentrant release that leaves
        the lease held): a call it starts while the release waits is seen at the next
        look, every :data:`RELEASE_RETRY` seconds at most, and the release goes beside
        it. Several releases may come at once: each is counted, and none waits for
        another's decision (one step under the state lock, see :meth:`_release_step`)
        nor for another's call."""
        with self._state_lock:
            self._releasing += 1
        mutex = self._mutex
        try:
            # A release's call under way (_unlocking) is not waited for either: this
            # release then sends nothing (see _release_step).
            while not (self._renewing or self._unlocking):
                if mutex.acquire(timeout=RELEASE_RETRY):
                    break
            else:
                return True  # counted until it has decided
        except BaseException:
            self._decided()
            raise
        self._decided()
        return False

    def _decided(self) -> None:
        """A release (or re-entry) counted by :meth:`_beside_a_call` has decided."""
        with self._state_lock:
            self._releasing -= 1

    def _call_may_start(self) -> bool:
        """Called by a renewal holding the mutex, with ``_renewing`` just set, before it
        sends its call: False when a release is under way, which then has the lease
        (see :meth:`_beside_a_call`); the renewal then sends nothing."""
        if self._releasing or self._unlocking:
            self._renewing = 0.0
            return False
        return True

    def _release_deferred(self, deferral: transactions.Deferral) -> None:
        """The release asked inside a transaction, now that it has ended."""
        if self._inherited():
            # A forked child ending its copy of the transaction: the lock is the
            # parent's (and its mutex may have been held by a thread at the fork).
            return
        # The state lock, not the mutex: a renewal stuck in its call holds that one,
        # and the release must not wait for it (see _release).
        with self._state_lock:
            if self._deferral is not deferral:
                return  # held again by a new acquisition meanwhile
            self._deferral = None
        try:
            self._release(deferrable=False)
        except LockError as exc:
            logger.error(
                "Could not release lock %r after its transaction ended: %s; it ends by "
                "expiry or when its connection closes",
                self.name, exc,
            )  # fmt: skip

    def release_after(self, seconds: float) -> None:
        """Let the lock run out ``seconds`` from now instead of freeing it now.

        For "lock at least for": a short periodic job keeps its lock for the whole
        period, so a node whose schedule runs late does not repeat it. The lease
        ends here (renewal stops); the server keeps the lock until the new expiry.
        Needs a backend whose locks expire on the server; raises :class:`LockLost`
        if the lease is already gone.
        """
        if not self._backend.expires_on_server:
            raise ValueError(
                f"release_after() needs a backend whose locks expire on the server; "
                f"backend {self.backend!r} frees its locks only when released or when "
                f"the holder's connection ends. Use a Redis backend for this lock."
            )
        seconds = validate_ttl(seconds, "release_after(seconds)")
        self.ensure_held()
        with self._mutex:
            self.ensure_held()
            if self._depth > 1:
                raise ValueError("release_after() cannot end a reentrant lease held twice.")
            started = time.monotonic()
            keep = getattr(self._backend, "keep", self._backend.extend)
            self._extended(started, seconds, keep(self.name, self.owner, seconds))
            self._release_requested = True
            self._set_released()
        self._on_finished()

    def _renew_once(self) -> float | None:
        """Called by the renewal thread; returns when to call it again (or None)."""
        with self._mutex:
            step, when = self._renew_step()
            if step == FREE_LOST:
                self._backend.release_quietly(self.name, self.owner)
            if step != EXTEND:
                return when
            self._renewing = started = time.monotonic()
            if not self._call_may_start():
                return started + RELEASE_RETRY  # if the release leaves it held (reentrant)
            outcome: bool | LockError
            try:
                outcome = self._backend.extend(self.name, self.owner, self.ttl)
            except LockError as exc:
                outcome = exc
            except BaseException:
                self._renewing = 0.0
                raise
            due = self._renew_result(started, outcome)
            if outcome is True and self._give_back_late():
                self._backend.release_quietly(self.name, self.owner)
            return due


class AsyncLease(BaseLease):
    """One acquisition of one lock, by one owner (asyncio API)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The renewal turn in flight, if any (renewal waits in its loop's renewer:
        # see distlocks.renewal.LoopRenewer).
        self._renew_task: asyncio.Task[None] | None = None
        self._alock = asyncio.Lock()

    def _renewal_turn(self, renewer: LoopRenewer) -> None:
        """Called by the loop's renewer when the lease is due: renew in a task, and have
        the renewer look at the lease at its deadline, in case the call is stuck."""
        self._renew_task = asyncio.get_running_loop().create_task(
            self._renew_and_reschedule(renewer), name=f"distlocks-renew:{self.name}"
        )
        renewer.watch(self)

    async def _renew_and_reschedule(self, renewer: LoopRenewer) -> None:
        due = await self._arenew_once()
        if self._renew_task is asyncio.current_task():
            self._renew_task = None
        if due is not None and not self._ended["ended"]:
            renewer.add(self, due)

    async def _arenew_once(self) -> float | None:
        async with self._alock:
            step, when = self._renew_step()
            if step == FREE_LOST:
                await self._backend.arelease_quietly(self.name, self.owner)
            if step != EXTEND:
                return when
            self._renewing = started = time.monotonic()
            outcome: bool | LockError
            try:
                outcome = await self._backend.aextend(self.name, self.owner, self.ttl)
            except LockError as exc:
                outcome = exc
            except BaseException:
                self._renewing = 0.0
                raise
            due = self._renew_result(started, outcome)
            if outcome is True and self._give_back_late():
                await self._backend.arelease_quietly(self.name, self.owner)
            return due

    def _stop_renewal(self) -> None:
        """Cancel the renewal turn in flight, if any (a lease waiting for its turn needs
        nothing: the renewer drops ended leases when it meets them)."""
        task, self._renew_task = self._renew_task, None
        if task is None:
            return
        loop = task.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            if task is not asyncio.current_task():
                task.cancel()
        elif not loop.is_closed():
            # Lost from another thread (e.g. held() called elsewhere): cancel on its loop.
            loop.call_soon_threadsafe(task.cancel)

    def _on_finished(self) -> None:
        super()._on_finished()
        if not self._renewing:
            self._stop_renewal()
        # else: lost at its deadline while a call is in flight: the turn is left to end,
        # so that a late success is given back (see _give_back_late).

    async def extend(self, ttl: float | None = None) -> None:
        """Reset the lease to ``ttl`` seconds from now; :class:`LockLost` if it is gone."""
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        self.ensure_held()
        async with self._alock:
            self.ensure_held()
            from distlocks.renewal import loop_renewer

            loop_renewer(asyncio.get_running_loop()).watch(self)
            self._renewing = started = time.monotonic()
            try:
                ok = await self._backend.aextend(self.name, self.owner, ttl)
            except BaseException:
                self._renewing = 0.0
                raise
            try:
                self._extended(started, ttl, ok)
            except LockLost:
                if ok and self._give_back_late():
                    await self._backend.arelease_quietly(self.name, self.owner)
                raise

    async def _reenter(self) -> None:
        """:meth:`Lease._reenter`: granted from local state while a renewal turn or an
        extension awaits its call, confirmed with the server otherwise."""
        self.ensure_held()
        if not (self._alock.locked() and self._renewing):
            await self.extend()
        self._enter_again()

    async def release(self) -> bool:
        """Free the lock if this lease still holds it; same rules as :meth:`Lease.release`."""
        if self._inherited():
            return False
        if self._alock.locked() and self._renewing:
            # A renewal turn, or the holder's extend(), awaits its call, which the server
            # may never answer: decided and sent without waiting for it, as
            # Lease._release does (the renewal turn is cancelled; an extension in flight
            # finds the lease released when it ends). Two releases at once send one
            # call: the decision claims it (see _release_step).
            freed = await self._release_call()
        else:
            async with self._alock:
                freed = await self._release_call()
        if not freed:
            return False
        self._on_finished()
        if signals.lock_released.receivers:  # skips building the arguments of a no-op
            signals.lock_released.send(sender=AsyncLease, lease=self)
        return True

    async def _release_call(self) -> bool:
        step = self._release_step()
        if step == FREE_LOST:
            await self._backend.arelease_quietly(self.name, self.owner)
        if step != RELEASE:
            return False
        self._stop_renewal()
        try:
            freed = await self._backend.arelease(self.name, self.owner)
        except BaseException:
            self._release_failed()
            raise
        return self._released(freed)


async def arelease_dropped(
    backend: LeaseServer, name: str, owner: str, ended: dict[str, Any]
) -> None:
    """:func:`release_dropped` for an asyncio lease, on the loop that renewed it."""
    if ended["ended"] or ended["pid"] != process.pid:
        return
    logger.warning("Lock %r was dropped without release(); releasing it", name)
    await backend.arelease_quietly(name, owner)


def release_dropped(backend: LeaseServer, name: str, owner: str, ended: dict[str, Any]) -> None:
    """Release the lock of a lease its holder dropped without releasing it (nobody can
    release it any more); ``ended`` is the lease's own flag, set when it ended."""
    if ended["ended"]:
        return  # released or lost before it was collected: nothing to do
    if ended["pid"] != process.pid:
        return  # a copy inherited by a forked child: the lock is the parent's
    logger.warning("Lock %r was dropped without release(); releasing it", name)
    backend.release_quietly(name, owner)
