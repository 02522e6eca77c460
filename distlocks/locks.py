"""The lock API: :func:`lock`, :func:`alock` and :func:`lock_many`.

Why this is one module of over 600 lines (issue 28's size rule): it is one concern,
taking and holding a lock. The acquisition loop (:class:`_Attempt`,
:func:`acquire_lease` and :func:`aacquire_lease`, :func:`finish_lease` and
:func:`afinish_lease`) has a blocking and an asyncio half that mirror each other
line for line and must wait, fail and send signals alike; the public spellings
(:class:`Lock`, :class:`AsyncLock`, :func:`lock_many`) are thin callers of it. Side by
side, a change to one half is checked against the other and against its callers;
split, the loop and its callers would be two files that always change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, ParamSpec, TypeVar

from distlocks import fencing, process, reentrancy, signals, transactions
from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LeaseServer, WaitServer
from distlocks.backends.capabilities import waiting_side
from distlocks.conf import conf
from distlocks.exceptions import LockError, LockLost, LockNotAcquired
from distlocks.handler import backends, check_alias
from distlocks.lease import AsyncLease, BaseLease, Lease, release_dropped
from distlocks.logs import log_expected
from distlocks.renewal import loop_renewer, renewer
from distlocks.validation import (
    MAX_TIMEOUT,
    MAX_TTL,
    validate_flag,
    validate_name,
    validate_timeout,
    validate_ttl,
)

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
L = TypeVar("L", bound=BaseLease)

_DEFAULT: Any = object()
# Waiting on a backend that cannot wake waiters backs off up to this.
MAX_POLL_INTERVAL = 0.1
FIRST_POLL_INTERVAL = 0.002

_HOSTNAME = socket.gethostname()

#: Extra holder metadata (e.g. a Celery task id) recorded with locks taken in this context.
holder_extra: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "distlocks_holder_extra", default=MappingProxyType({})
)


# The last Holder built by each thread: most threads take lock after lock with the
# same name, pid and extra metadata, and a Holder is immutable, so it can be reused.
_holders = threading.local()


def current_holder() -> Holder:
    """Who is asking: this host, process and thread, and the context's extra metadata."""
    thread = threading.current_thread().name
    extra = holder_extra.get()
    pid = process.pid  # renewed in a forked child, which must record its own
    holder: Holder | None = getattr(_holders, "holder", None)
    if holder is None or holder.thread != thread or holder.extra is not extra or holder.pid != pid:
        holder = _holders.holder = Holder(host=_HOSTNAME, pid=pid, thread=thread, extra=extra)
    return holder


def new_owner() -> str:
    """A random owner id for one acquisition: 128 random bits as 32 hex characters
    (the length the live-lock table stores), without building a UUID object."""
    return os.urandom(16).hex()


class _Attempt:
    """One acquisition: its owner, waiting policy and wait-queue registration.

    The blocking and the asyncio loops share it and differ only in how they call
    the backend. Waits are measured on the monotonic clock.
    """

    # One per acquisition: slots make it cheaper to build.
    __slots__ = (
        "_waits", "backend", "began", "deadline", "fair", "holder", "interval", "name",
        "options", "owner", "registered", "timeout", "ttl",
    )  # fmt: skip

    def __init__(
        self,
        backend: LeaseServer,
        name: str,
        *,
        ttl: float,
        timeout: float | None,
        deadline: float | None,
        fair: bool,
        options: Mapping[str, Any],
    ) -> None:
        #: When the acquisition began (monotonic), for the wait time the signals report.
        self.began = time.monotonic()
        self.backend = backend
        self._waits: WaitServer | None = None
        self.name = name
        self.ttl = ttl
        self.timeout = timeout
        if deadline is None and timeout is not None:
            deadline = self.began + timeout
        self.deadline = deadline
        self.fair = fair
        self.options = options
        self.owner = new_owner()
        self.holder = current_holder()
        self.interval = FIRST_POLL_INTERVAL
        #: True while the backend may list this caller as a waiter (to be undone).
        self.registered = False

    @property
    def waits(self) -> WaitServer:
        """What to wait on between attempts: the backend, or polling where it cannot
        wake waiters (it does not declare the Waiting capability). Looked up at the
        first wait (a class check): most acquisitions never wait."""
        waits = self._waits
        if waits is None:
            waits = self._waits = waiting_side(self.backend)
        return waits

    def budget(self) -> float:
        """How long this caller may still wait, for the backend's waiter registration."""
        if self.timeout == 0:
            return 0.0
        budget = 3600.0 if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        self.registered = self.registered or budget > 0
        return budget

    def granted(self, result: AcquireResult) -> bool:
        if result.acquired:
            self.registered = False  # the grant itself removed the registration
        return result.acquired

    def next_wait(self, result: AcquireResult) -> float:
        """Seconds to block before the next attempt; LockNotAcquired when time is up."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise LockNotAcquired(self.name, self.backend.alias, self.timeout)
        if self.waits.wakes_on_release:
            # The release wakes us; the timer only covers a holder that dies
            # without releasing (its lease runs out) and lost wake-ups.
            wait = 3600.0
        else:
            wait = self.interval
            self.interval = min(self.interval * 2, MAX_POLL_INTERVAL)
        if result.remaining is not None:
            # The holder's lease ends then at the latest.
            wait = min(wait, result.remaining + 0.001)
        if self.deadline is not None:
            wait = min(wait, self.deadline - now)
        return max(wait, 0.0)

    def lease(self, cls: type[L], result: AcquireResult, started: float) -> L:
        """The lease of the grant ``result`` (a :class:`Lease` or :class:`AsyncLease`)."""
        if not self.backend.expires_on_server:
            # Nothing expires on the server, and the call may have waited in its
            # queue: the local lease starts at the grant.
            started = time.monotonic()
        options = self.options
        return cls(
            backend=self.backend,
            name=self.name,
            owner=self.owner,
            fencing_token=result.fencing_token,
            ttl=self.ttl,
            started=started,
            remaining=result.remaining,
            on_lost=options.get("on_lost"),
            auto_renew=options.get("auto_renew", True),
            max_hold=options.get("max_hold"),
            release_on_commit=options.get("release_on_commit"),
        )

    def guard(self, lease: BaseLease, due: float | None) -> None:
        """A lease that nothing renews (``due`` is None) and the server never ends: if
        its holder drops it without releasing, release it then (off the collector's
        thread)."""
        if due is None and not self.backend.expires_on_server:
            weakref.finalize(
                lease, _when_dropped, self.backend, self.name, self.owner, lease._ended
            )


#: Names that passed validate_name() (a pure function of the string): a lock object is
#: typically built per use, always with one of the same few names.
_valid_names: dict[str, None] = {}


def _checked_name(name: Any) -> str:
    if type(name) is str and name in _valid_names:
        return name
    name = validate_name(name)
    if type(name) is str:  # a subclass could compare equal to a name it is not
        if len(_valid_names) >= 4096:
            _valid_names.clear()
        _valid_names[name] = None
    return name


def _ttl_arg(value: Any, what: str = "ttl") -> float:
    """``validate_ttl(value, what)``, the usual value (a plain float or int in range)
    passed by two comparisons. Only the exact types: a bool is an int that is no lease
    length, and NaN fails both comparisons, so it goes to the full check."""
    kind = type(value)
    if (kind is float or kind is int) and 0.01 <= value <= MAX_TTL:
        return float(value)
    return validate_ttl(value, what)


def _timeout_arg(value: Any) -> float | None:
    """``validate_timeout(value)``, with the same shortcut as :func:`_ttl_arg`."""
    kind = type(value)
    if (kind is float or kind is int) and 0 <= value <= MAX_TIMEOUT:
        return float(value)
    return validate_timeout(value)


def _when_dropped(backend: LeaseServer, name: str, owner: str, ended: dict[str, Any]) -> None:
    """The finalizer of a guarded lease: a lease that ended (released, lost) or that a
    forked child inherited needs nothing, and most leases are collected after they
    ended, so only a lease really dropped while held costs a clean-up thread."""
    if not ended["ended"] and ended["pid"] == process.pid:
        _in_thread(release_dropped, backend, name, owner, ended)


def _in_thread(func: Callable[..., object], *args: Any) -> None:
    # At interpreter exit the finalizers of leases still alive run (weakref.finalize's
    # own exit hook): a daemon thread started then is killed before it frees the lock,
    # and Python 3.12+ refuses to start one at all. Free it here and now instead.
    if not getattr(weakref.finalize, "_shutdown", False) and not sys.is_finalizing():
        try:
            thread = threading.Thread(target=func, args=args, name="distlocks-cleanup")
            thread.daemon = True
            thread.start()
            return
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            pass
    try:
        func(*args)
    except Exception:  # the process is exiting; nothing is left to tell
        logger.debug("Cleanup at interpreter exit failed", exc_info=True)


def acquire_lease(
    backend: LeaseServer,
    name: str,
    *,
    ttl: float,
    timeout: float | None,
    deadline: float | None = None,
    fair: bool = False,
    **options: Any,
) -> Lease:
    """Acquire ``name`` on ``backend``, waiting up to ``timeout`` seconds.

    ``deadline`` (monotonic) overrides ``timeout`` when several locks share one budget.
    """
    if transactions.pending:
        # This thread released this lock inside a transaction that has not ended: it
        # still holds it, and gets it back rather than wait for itself.
        taken = transactions.take_back(backend, name)
        if taken is not None:
            return taken
    attempt = _Attempt(
        backend, name, ttl=ttl, timeout=timeout, deadline=deadline, fair=fair, options=options
    )
    owner, holder = attempt.owner, attempt.holder
    try:
        started = time.monotonic()
        result = backend.acquire(name, owner, ttl, holder, wait=attempt.budget(), fair=fair)
        # A backend that can wait and try again in one round trip (Redis) does so.
        combined = None if result.acquired else getattr(backend, "wait_and_acquire", None)
        while not attempt.granted(result):
            seconds = attempt.next_wait(result)
            again = None
            if combined is not None:
                started = time.monotonic()
                again = combined(
                    name, owner, ttl, holder, seconds, wait=attempt.budget(), fair=fair
                )
            if again is None:
                attempt.waits.wait(name, seconds, owner=owner, fair=fair)
                started = time.monotonic()
                again = backend.acquire(name, owner, ttl, holder, wait=attempt.budget(), fair=fair)
            result = again
    except LockError as exc:
        _not_acquired(attempt.backend, name, attempt.began, exc)
        raise
    finally:
        if attempt.registered:
            _leave_quietly(attempt.waits, name, owner)
    lease = attempt.lease(Lease, result, started)
    due = lease._renewal_due()
    if due is not None:
        renewer(backend.alias).add(lease, due)
    else:
        attempt.guard(lease, due)
    try:
        # send() would return at once too; checking first skips building its arguments.
        if signals.lock_acquired.receivers:
            signals.lock_acquired.send(
                sender=Lease, lease=lease, waited=time.monotonic() - attempt.began
            )
    except BaseException:
        # A failing receiver must not leave a lease that nobody will release.
        with contextlib.suppress(Exception):
            lease.release()
        raise
    return lease


def try_once(
    backend: LeaseServer,
    name: str,
    ttl: float,
    fair: bool,
    on_lost: Callable[[Any], object] | None,
    auto_renew: bool,
    max_hold: float | None,
    release_on_commit: bool | None,
) -> Lease:
    """:func:`acquire_lease` with ``timeout=0`` (one try, no wait), as ``lock(...,
    timeout=0)`` runs it: the same steps, signals and failures, without the waiting
    machinery (an :class:`_Attempt`, its budget and its wait queue), which a try never
    uses. Most lock cycles are tries."""
    if transactions.pending:
        taken = transactions.take_back(backend, name)
        if taken is not None:
            return taken
    began = time.monotonic()
    owner = os.urandom(16).hex()  # new_owner(), inlined
    holder = current_holder()
    try:
        result = backend.acquire(name, owner, ttl, holder, wait=0.0, fair=fair)
        if not result.acquired:
            raise LockNotAcquired(name, backend.alias, 0.0)
    except LockError as exc:
        _not_acquired(backend, name, began, exc)
        raise
    # The lease's local term starts before the request where the server keeps the
    # expiry, at the grant where it does not (as _Attempt.lease()).
    lease = Lease(
        backend=backend,
        name=name,
        owner=owner,
        fencing_token=result.fencing_token,
        ttl=ttl,
        started=began if backend.expires_on_server else time.monotonic(),
        remaining=result.remaining,
        on_lost=on_lost,
        auto_renew=auto_renew,
        max_hold=max_hold,
        release_on_commit=release_on_commit,
    )
    due = lease._renewal_due()
    if due is not None:
        renewer(backend.alias).add(lease, due)
    elif not backend.expires_on_server:
        # _Attempt.guard(): released if dropped unreleased, nothing renewing it.
        weakref.finalize(lease, _when_dropped, backend, name, owner, lease._ended)
    announce_acquired(lease, began)
    return lease


def announce_acquired(lease: Lease, began: float) -> None:
    """Tell ``lock_acquired`` receivers of a new ``lease`` (asked for at ``began``,
    monotonic). A receiver that fails gives the lease back before its error goes on:
    the caller never gets the lease, so nobody else would release it."""
    # send() would return at once too; checking first skips building its arguments.
    if not signals.lock_acquired.receivers:
        return
    try:
        signals.lock_acquired.send(sender=Lease, lease=lease, waited=time.monotonic() - began)
    except BaseException:
        with contextlib.suppress(Exception):
            lease.release()
        raise


def _not_acquired(backend: LeaseServer, name: str, began: float, error: LockError) -> None:
    """Tell ``lock_not_acquired`` receivers (e.g. metrics) that no lease came of it."""
    if not signals.lock_not_acquired.receivers:
        return
    signals.lock_not_acquired.send_robust(
        sender=type(backend),
        name=name,
        backend=backend.alias,
        waited=time.monotonic() - began,
        error=error,
    )


def _leave_quietly(backend: WaitServer, name: str, owner: str) -> None:
    try:
        backend.leave_queue(name, owner)
    except Exception as exc:
        # The registration lapses by itself within a second or so.
        log_expected(logger, exc, "Could not leave the wait queue of %r", name)


async def aacquire_lease(
    backend: LeaseServer,
    name: str,
    *,
    ttl: float,
    timeout: float | None,
    deadline: float | None = None,
    fair: bool = False,
    **options: Any,
) -> AsyncLease:
    """The asyncio counterpart of :func:`acquire_lease`."""
    attempt = _Attempt(
        backend, name, ttl=ttl, timeout=timeout, deadline=deadline, fair=fair, options=options
    )
    owner, holder = attempt.owner, attempt.holder
    try:
        started = time.monotonic()
        result = await backend.aacquire(name, owner, ttl, holder, wait=attempt.budget(), fair=fair)
        combined = None if result.acquired else getattr(backend, "await_and_acquire", None)
        while not attempt.granted(result):
            seconds = attempt.next_wait(result)
            again = None
            if combined is not None:
                started = time.monotonic()
                again = await combined(
                    name, owner, ttl, holder, seconds, wait=attempt.budget(), fair=fair
                )
            if again is None:
                await attempt.waits.await_release(name, seconds, owner=owner, fair=fair)
                started = time.monotonic()
                again = await backend.aacquire(
                    name, owner, ttl, holder, wait=attempt.budget(), fair=fair
                )
            result = again
    except LockError as exc:
        _not_acquired(attempt.backend, name, attempt.began, exc)
        raise
    finally:
        if attempt.registered:
            try:
                await attempt.waits.aleave_queue(name, owner)
            except Exception as exc:
                log_expected(logger, exc, "Could not leave the wait queue of %r", name)
    lease = attempt.lease(AsyncLease, result, started)
    due = lease._renewal_due()
    if due is not None:
        loop_renewer(asyncio.get_running_loop()).add(lease, due)
    attempt.guard(lease, due)
    try:
        if signals.lock_acquired.receivers:
            signals.lock_acquired.send(
                sender=AsyncLease, lease=lease, waited=time.monotonic() - attempt.began
            )
    except BaseException:
        with contextlib.suppress(Exception):
            await lease.release()
        raise
    return lease


def _exit_problem(lease: BaseLease, body_failed: bool) -> LockLost | None:
    """The LockLost to raise at the end of a block, if any."""
    if body_failed or lease._state != "lost":
        return None
    return LockLost(lease, lease.lost_reason)  # type: ignore[arg-type]


def finish_lease(lease: Lease, body_failed: bool) -> None:
    """Release ``lease`` at the end of a ``with`` block or decorated call.

    A lease lost while inside raises :class:`LockLost`, unless the body itself
    raised (its exception is the one the caller needs to see; the loss is still
    logged and signalled).
    """
    try:
        # Notices a lease that ran out while inside (its release step asks held()).
        lease._release(deferrable=True)  # what release() runs, one call less
    except LockError:
        if body_failed:
            logger.exception("Could not release lock %r after an error in its block", lease.name)
            return
        raise
    if not body_failed and lease._state == "lost":
        raise LockLost(lease, lease.lost_reason)


async def afinish_lease(lease: AsyncLease, body_failed: bool) -> None:
    """The asyncio counterpart of :func:`finish_lease`."""
    lease.held()
    try:
        await lease.release()
    except LockError:
        if body_failed:
            logger.exception("Could not release lock %r after an error in its block", lease.name)
            return
        raise
    problem = _exit_problem(lease, body_failed)
    if problem is not None:
        raise problem


class _LockBase:
    """Arguments and validation shared by :class:`Lock` and :class:`AsyncLock`.

    ``ttl``: lease length in seconds (default ``DISTLOCKS_DEFAULT_TTL``).
    ``timeout``: how long to wait for a busy lock; ``0`` tries once, ``None`` waits
    forever (default ``DISTLOCKS_DEFAULT_TIMEOUT``).
    ``auto_renew``: extend the lease at about ttl/3 while it is held.
    ``reentrant``: the same thread (or asyncio task) may take it again; released at
    the outermost exit, with the same fencing token.
    ``fair``: waiters are served in arrival order.
    ``max_hold``: stop renewing after this many seconds, so a hung holder loses it.
    ``on_lost``: called with the lease if it is lost while held.
    ``release_on_commit``: a release inside ``transaction.atomic()`` frees the lock
    only when the transaction commits or rolls back (default
    ``DISTLOCKS_RELEASE_ON_COMMIT``, True); False frees it at once.
    Arguments are checked here, at the call, with a message saying what to change.
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str = "default",
        ttl: float | None = None,
        timeout: float | None = _DEFAULT,
        auto_renew: bool = True,
        reentrant: bool = False,
        fair: bool = False,
        max_hold: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
        release_on_commit: bool | None = None,
    ) -> None:
        # _checked_name(), _ttl_arg() and _timeout_arg() inlined for the usual values
        # (a lock object is usually built per use): anything else takes the full check.
        if type(name) is not str or name not in _valid_names:
            name = _checked_name(name)
        self.name = name
        if type(backend) is not str or backend not in backends._backends:
            check_alias(backend)  # the usual alias, already built, needs no look
        self.backend_alias = backend
        if ttl is not None:
            kind = type(ttl)
            ttl = (
                float(ttl)
                if (kind is float or kind is int) and 0.01 <= ttl <= MAX_TTL
                else _ttl_arg(ttl)
            )
        self._ttl = ttl
        given: Any = timeout  # any object: checked here
        if given is not _DEFAULT:
            kind = type(given)
            if not ((kind is float or kind is int) and 0 <= given <= MAX_TIMEOUT):
                given = _timeout_arg(given)
            elif kind is int:
                given = float(given)
        self._timeout = given
        # Flags are checked only when not one of the two bools (the usual case).
        if auto_renew is not True and auto_renew is not False:
            validate_flag(auto_renew, "auto_renew")
        self.auto_renew = auto_renew
        if reentrant is not False and reentrant is not True:
            validate_flag(reentrant, "reentrant")
        self.reentrant = reentrant
        if fair is not False and fair is not True:
            validate_flag(fair, "fair")
        self.fair = fair
        if max_hold is not None:
            max_hold = _ttl_arg(max_hold, "max_hold")
        self.max_hold = max_hold
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be a callable taking the lease, not {on_lost!r}.")
        self.on_lost = on_lost
        if release_on_commit is not None:
            release_on_commit = validate_flag(release_on_commit, "release_on_commit")
        self.release_on_commit = release_on_commit
        # What each thread entered and has not left yet, by thread id (one object may
        # be entered by several threads at once). A plain dict: a threading.local would
        # cost more to create than the rest of a short-lived lock object.
        self._entered: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} backend={self.backend_alias!r}>"

    @property
    def ttl(self) -> float:
        return self._ttl if self._ttl is not None else _ttl_arg(conf.DEFAULT_TTL)

    @property
    def timeout(self) -> float | None:
        if self._timeout is _DEFAULT:
            return _timeout_arg(conf.DEFAULT_TIMEOUT)
        return self._timeout

    @property
    def backend(self) -> BaseBackend:
        # The built backend straight from the handler's dict (the usual case), without
        # the handler's method call.
        found = backends._backends.get(self.backend_alias)
        return found if found is not None else backends[self.backend_alias]

    def _options(self) -> dict[str, Any]:
        return {
            "on_lost": self.on_lost,
            "auto_renew": self.auto_renew,
            "max_hold": self.max_hold,
            "release_on_commit": self.release_on_commit,
        }

    def _reentrant_lease(self) -> BaseLease | None:
        """The caller's own reentrant lease on this name, if it holds one (one whose
        transaction ended, on PostgreSQL's transaction mode, is over: forgotten)."""
        if not self.reentrant:
            return None
        lease = reentrancy.current(self.backend_alias, self.name)
        ended = getattr(lease._backend, "lease_ended", None) if lease is not None else None
        if lease is not None and ended is not None and ended(self.name, lease.owner):
            lease._set_released()
            reentrancy.forget(lease)
            return None
        return lease


class Lock(_LockBase):
    """A lock on one name: a context manager, a decorator, or explicit ``acquire()``.

    Built as ``lock(name, ...)``. The object holds no lease itself between
    uses, so one decorated function may run in many threads at once, each
    acquiring its own lease.
    """

    def acquire(self, *, timeout: float | None = _DEFAULT) -> Lease:
        """Acquire a lease, waiting up to ``timeout`` seconds (default: the lock's).

        Raises :class:`LockNotAcquired` when the lock stays busy,
        :class:`LockBackendUnavailable` when the server cannot be reached.
        """
        # The properties' usual values read directly (three calls fewer a cycle).
        if timeout is not _DEFAULT:
            wait = _timeout_arg(timeout)
        else:
            wait = self._timeout
            if wait is _DEFAULT:
                wait = self.timeout
        again = self._reentrant_lease() if self.reentrant else None
        if isinstance(again, Lease):
            # Confirmed with the server (and refreshed) rather than trusting local state:
            # re-entering a lock lost under the outer block must fail loudly. Never
            # waits for a renewal's call in flight (see Lease._reenter).
            again._reenter()
            return again
        backend = backends._backends.get(self.backend_alias)
        ttl = self._ttl
        if wait == 0 and not self.reentrant:  # a try: no waiting machinery
            return try_once(
                self.backend if backend is None else backend,
                self.name,
                self.ttl if ttl is None else ttl,
                self.fair,
                self.on_lost,
                self.auto_renew,
                self.max_hold,
                self.release_on_commit,
            )
        lease = acquire_lease(
            self.backend if backend is None else backend,
            self.name,
            ttl=self.ttl if ttl is None else ttl,
            timeout=wait,
            fair=self.fair,
            on_lost=self.on_lost,
            auto_renew=self.auto_renew,
            max_hold=self.max_hold,
            release_on_commit=self.release_on_commit,
        )
        if self.reentrant:
            reentrancy.remember(lease)
        return lease

    def __enter__(self) -> Lease:
        lease = self.acquire()
        # Saves of fenced rows inside the block find the lease (and its token) here.
        entry = (lease, fencing.enter(lease))
        stack: list[tuple[Lease, Any]] | None = self._entered.get(threading.get_ident())
        if stack is None:
            self._entered[threading.get_ident()] = [entry]
        else:
            stack.append(entry)
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        ident = threading.get_ident()
        stack: list[tuple[Lease, Any]] = self._entered[ident]
        lease, token = stack.pop()
        if not stack:
            del self._entered[ident]
        fencing.leave(token)
        finish_lease(lease, body_failed=exc_type is not None)

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"lock() cannot decorate the coroutine function {func.__qualname__}; "
                f"use alock() for async code."
            )
        if inspect.isgeneratorfunction(func):
            raise TypeError(
                f"lock() cannot decorate the generator function {func.__qualname__}: the lock "
                f"would be held only while the generator is created. Take the lock inside it."
            )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            lease = self.acquire()
            token = fencing.enter(lease)
            try:
                result = func(*args, **kwargs)
            except BaseException:
                fencing.leave(token)
                finish_lease(lease, body_failed=True)
                raise
            fencing.leave(token)
            finish_lease(lease, body_failed=False)
            return result

        return wrapper


class AsyncLock(_LockBase):
    """The asyncio lock: ``async with alock(...) as lease``, a decorator for coroutine
    functions, or ``await alock(...).acquire()``. Same arguments and semantics as
    :class:`Lock`; renewal runs on the loop that took the lease (each renewal turn
    an asyncio task), and reentrancy is per asyncio task.

    A release is never deferred to a transaction's end: Django runs no
    ``transaction.atomic()`` in async code (it refuses it there). Code that writes in a
    transaction runs in a ``sync_to_async`` function, and takes ``lock()`` there."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        if self.release_on_commit:
            raise ValueError(
                "alock() cannot wait for a transaction's COMMIT: async code runs no "
                "transaction.atomic(). Take lock() inside the sync_to_async function that "
                "opens the transaction, or drop release_on_commit."
            )

    async def acquire(self, *, timeout: float | None = _DEFAULT) -> AsyncLease:
        """Acquire a lease, waiting up to ``timeout`` seconds without blocking the loop."""
        wait = self.timeout if timeout is _DEFAULT else _timeout_arg(timeout)
        again = self._reentrant_lease()
        if isinstance(again, AsyncLease):
            await again._reenter()
            return again
        lease = await aacquire_lease(
            self.backend, self.name, ttl=self.ttl, timeout=wait, fair=self.fair, **self._options()
        )
        if self.reentrant:
            reentrancy.remember(lease)
        return lease

    def _leases(self) -> dict[int, list[tuple[AsyncLease, Any]]]:
        # Per thread and task, since one AsyncLock may be entered by several tasks at once.
        leases: dict[int, list[tuple[AsyncLease, Any]]] = self._entered.setdefault(
            threading.get_ident(), {}
        )
        return leases

    @staticmethod
    def _task_key() -> int:
        import asyncio

        return id(asyncio.current_task())

    async def __aenter__(self) -> AsyncLease:
        lease = await self.acquire()
        self._leases().setdefault(self._task_key(), []).append((lease, fencing.enter(lease)))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leases = self._leases()
        key = self._task_key()
        lease, token = leases[key].pop()
        if not leases[key]:
            del leases[key]
            if not leases:
                self._entered.pop(threading.get_ident(), None)
        fencing.leave(token)
        await afinish_lease(lease, body_failed=exc_type is not None)

    def __call__(
        self, func: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"alock() decorates coroutine functions; {func.__qualname__} is not one. "
                f"Use lock() for plain functions."
            )

        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            lease = await self.acquire()
            token = fencing.enter(lease)
            try:
                result = await func(*args, **kwargs)
            except BaseException:
                fencing.leave(token)
                await afinish_lease(lease, body_failed=True)
                raise
            fencing.leave(token)
            await afinish_lease(lease, body_failed=False)
            return result

        return wrapper


#: ``lock(name, ...)``: build a :class:`Lock` (the public spelling).
lock = Lock
#: ``alock(name, ...)``: build an :class:`AsyncLock` (the public spelling).
alock = AsyncLock


def _ordered_names(names: Iterable[str]) -> list[str]:
    if isinstance(names, str):
        raise TypeError("lock_many() takes a list of names, not one str; use lock() for one.")
    ordered = sorted({validate_name(name) for name in names})
    if not ordered:
        raise ValueError("lock_many() needs at least one name.")
    return ordered


def lock_many(
    names: Iterable[str],
    *,
    backend: str = "default",
    ttl: float | None = None,
    timeout: float | None = _DEFAULT,
    auto_renew: bool = True,
    max_hold: float | None = None,
    on_lost: Callable[[Lease], object] | None = None,
    release_on_commit: bool | None = None,
) -> contextlib.AbstractContextManager[dict[str, Lease]]:
    """Hold several locks at once: all or none.

    Names are deduplicated and taken in sorted order (so two callers asking for
    overlapping sets can never deadlock), within one shared ``timeout``; if one
    cannot be taken, those already taken are released and :class:`LockNotAcquired`
    is raised. Yields ``{name: lease}``; leases are released in reverse order.
    """
    # Arguments are checked here, at the call, not when the block is entered.
    ordered = _ordered_names(names)
    template = Lock(
        ordered[0],
        backend=backend,
        ttl=ttl,
        timeout=timeout,
        auto_renew=auto_renew,
        max_hold=max_hold,
        on_lost=on_lost,
        release_on_commit=release_on_commit,
    )
    check = getattr(template.backend, "check_lock_many", None)
    if check is not None:
        # A set the backend can never hold at once (PostgreSQL's session mode: more
        # names than pooled connections) is refused now, not after its timeout.
        check(ordered, ())
    return _hold_many(ordered, template)


def _enclosing_owners(alias: str) -> list[str]:
    """The owners of this context's leases on ``alias`` whose blocks enclose the call.
    Only blocking leases: an asyncio task's may be released by its task meanwhile."""
    return [
        lease.owner
        for lease in fencing._active.get()  # the stack fencing.enter() keeps
        if isinstance(lease, Lease) and lease.backend == alias
    ]


@contextlib.contextmanager
def _hold_many(ordered: list[str], template: Lock) -> Iterator[dict[str, Lease]]:
    backend = template.backend
    check = getattr(backend, "check_lock_many", None)
    if check is not None:
        # Again at entry, with the leases this caller holds around the block: those
        # only it can give back, and it is waiting here.
        check(ordered, _enclosing_owners(backend.alias))
    wait = template.timeout
    deadline = None if wait is None else time.monotonic() + wait
    held: list[Lease] = []
    try:
        for name in ordered:
            held.append(
                acquire_lease(
                    backend,
                    name,
                    ttl=template.ttl,
                    timeout=wait,
                    deadline=deadline,
                    **template._options(),
                )
            )
    except BaseException:
        for lease in reversed(held):
            try:
                lease.release()
            except Exception:
                logger.exception("Could not release %r while backing out of lock_many", lease)
        raise
    body_failed = False
    tokens = [fencing.enter(lease) for lease in held]
    try:
        yield {lease.name: lease for lease in held}
    except BaseException:
        body_failed = True
        raise
    finally:
        for token in reversed(tokens):
            fencing.leave(token)
        errors: list[BaseException] = []
        for lease in reversed(held):
            try:
                finish_lease(lease, body_failed=body_failed)
            except Exception as exc:
                errors.append(exc)
        if errors and not body_failed:
            raise errors[0]
