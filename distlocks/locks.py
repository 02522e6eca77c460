"""The synchronous lock API: :func:`lock` and :func:`lock_many`."""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType, TracebackType
from typing import Any, ParamSpec, TypeVar

from distlocks import signals
from distlocks.backends.base import BaseBackend, Holder
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from distlocks.handler import backends, check_alias
from distlocks.lease import Lease
from distlocks.validation import validate_name, validate_timeout, validate_ttl

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT: Any = object()
# Waiting for a busy lock without wake-ups from the server backs off up to this.
MAX_POLL_INTERVAL = 0.1
FIRST_POLL_INTERVAL = 0.002

_HOSTNAME = socket.gethostname()

#: Extra holder metadata (e.g. a Celery task id) recorded with locks taken in this context.
holder_extra: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "distlocks_holder_extra", default=MappingProxyType({})
)


def current_holder() -> Holder:
    return Holder(
        host=_HOSTNAME,
        pid=os.getpid(),
        thread=threading.current_thread().name,
        extra=holder_extra.get(),
    )


def new_owner() -> str:
    return uuid.uuid4().hex


def acquire_lease(
    backend: BaseBackend,
    name: str,
    *,
    ttl: float,
    timeout: float | None,
    on_lost: Callable[[Lease], object] | None = None,
    deadline: float | None = None,
) -> Lease:
    """Acquire ``name`` on ``backend``, waiting up to ``timeout`` seconds.

    The wait is measured on the monotonic clock. ``deadline`` (monotonic) overrides
    ``timeout`` when several locks share one budget.
    """
    if deadline is None and timeout is not None:
        deadline = time.monotonic() + timeout
    owner = new_owner()
    holder = current_holder()
    interval = FIRST_POLL_INTERVAL
    while True:
        started = time.monotonic()
        result = backend.acquire(name, owner, ttl, holder)
        if result.acquired:
            lease = Lease(
                backend=backend,
                name=name,
                owner=owner,
                fencing_token=result.fencing_token,
                ttl=ttl,
                started=started,
                remaining=result.remaining,
                on_lost=on_lost,
            )
            signals.lock_acquired.send(sender=Lease, lease=lease)
            return lease
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise LockNotAcquired(name, backend.alias, timeout)
        wait = interval
        if result.remaining is not None:
            # The holder's lease ends then at the latest: no point sleeping past it.
            wait = min(wait, result.remaining + 0.001)
        if deadline is not None:
            wait = min(wait, deadline - now)
        backend.wait(name, wait)
        interval = min(interval * 2, MAX_POLL_INTERVAL)


def finish_lease(lease: Lease, body_failed: bool) -> None:
    """Release ``lease`` at the end of a ``with`` block or decorated call.

    A lease lost while inside raises :class:`LockLost`, unless the body itself raised
    (its exception is the one the caller needs to see; the loss is still logged and
    signalled).
    """
    lost_inside = not lease.held()
    try:
        freed = lease.release()
    except LockBackendUnavailable:
        if body_failed:
            logger.exception("Could not release lock %r after an error in its block", lease.name)
            return
        raise
    if (lost_inside or not freed) and not body_failed and lease.state == "lost":
        raise LockLost(lease, lease.lost_reason)


class Lock:
    """A lock on one name: a context manager, a decorator, or explicit ``acquire()``.

    Build it with :func:`distlocks.lock`. The object holds no lease itself between
    uses, so one decorated function may run in many threads at once, each
    acquiring its own lease.
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
        on_lost: Callable[[Lease], object] | None = None,
    ) -> None:
        self.name = validate_name(name)
        check_alias(backend)
        self.backend_alias = backend
        self._ttl = None if ttl is None else validate_ttl(ttl)
        self._timeout = timeout if timeout is _DEFAULT else validate_timeout(timeout)
        self.auto_renew = bool(auto_renew)
        self.reentrant = bool(reentrant)
        self.on_lost = on_lost
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"<Lock {self.name!r} backend={self.backend_alias!r}>"

    @property
    def ttl(self) -> float:
        return self._ttl if self._ttl is not None else validate_ttl(conf.DEFAULT_TTL)

    @property
    def timeout(self) -> float | None:
        if self._timeout is _DEFAULT:
            return validate_timeout(conf.DEFAULT_TIMEOUT)
        return self._timeout

    @property
    def backend(self) -> BaseBackend:
        return backends[self.backend_alias]

    def acquire(self, *, timeout: float | None = _DEFAULT) -> Lease:
        """Acquire a new lease, waiting up to ``timeout`` seconds (default: the lock's).

        Raises :class:`LockNotAcquired` when the lock stays busy,
        :class:`LockBackendUnavailable` when the server cannot be reached.
        """
        wait = self.timeout if timeout is _DEFAULT else validate_timeout(timeout)
        return acquire_lease(
            self.backend, self.name, ttl=self.ttl, timeout=wait, on_lost=self.on_lost
        )

    def _stack(self) -> list[Lease]:
        stack: list[Lease] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> Lease:
        lease = self.acquire()
        self._stack().append(lease)
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._stack().pop()
        finish_lease(lease, body_failed=exc_type is not None)

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func):
            raise TypeError(
                f"lock() cannot decorate the coroutine function {func.__qualname__}; "
                f"use alock() for async code."
            )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            lease = self.acquire()
            try:
                result = func(*args, **kwargs)
            except BaseException:
                finish_lease(lease, body_failed=True)
                raise
            finish_lease(lease, body_failed=False)
            return result

        return wrapper


def lock(
    name: str,
    *,
    backend: str = "default",
    ttl: float | None = None,
    timeout: float | None = _DEFAULT,
    auto_renew: bool = True,
    reentrant: bool = False,
    on_lost: Callable[[Lease], object] | None = None,
) -> Lock:
    """A lock on ``name``, used as ``with lock(...) as lease:``, as a decorator, or
    through ``lock(...).acquire()``.

    ``ttl`` is the lease length in seconds (default ``DISTLOCKS_DEFAULT_TTL``);
    ``timeout`` how long to wait for a busy lock (``0`` tries once, ``None`` waits
    forever; default ``DISTLOCKS_DEFAULT_TIMEOUT``).
    """
    return Lock(
        name,
        backend=backend,
        ttl=ttl,
        timeout=timeout,
        auto_renew=auto_renew,
        reentrant=reentrant,
        on_lost=on_lost,
    )


@contextmanager
def lock_many(
    names: Iterable[str],
    *,
    backend: str = "default",
    ttl: float | None = None,
    timeout: float | None = _DEFAULT,
    auto_renew: bool = True,
    on_lost: Callable[[Lease], object] | None = None,
) -> Iterator[dict[str, Lease]]:
    """Hold several locks at once: all or none.

    Names are deduplicated and taken in sorted order (so two callers asking for
    overlapping sets can never deadlock), within one shared ``timeout``; if one
    cannot be taken, those already taken are released and :class:`LockNotAcquired`
    is raised. Yields ``{name: lease}``; leases are released in reverse order.
    """
    if isinstance(names, str):
        raise TypeError("lock_many() takes a list of names, not one str; use lock() for one.")
    ordered = sorted({validate_name(name) for name in names})
    if not ordered:
        raise ValueError("lock_many() needs at least one name.")
    template = Lock(ordered[0], backend=backend, ttl=ttl, timeout=timeout, auto_renew=auto_renew)
    wait = template.timeout
    deadline = None if wait is None else time.monotonic() + wait
    held: list[Lease] = []
    try:
        for name in ordered:
            held.append(
                acquire_lease(
                    template.backend,
                    name,
                    ttl=template.ttl,
                    timeout=wait,
                    on_lost=on_lost,
                    deadline=deadline,
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
    try:
        yield {lease.name: lease for lease in held}
    except BaseException:
        body_failed = True
        raise
    finally:
        errors: list[BaseException] = []
        for lease in reversed(held):
            try:
                finish_lease(lease, body_failed=body_failed)
            except Exception as exc:
                errors.append(exc)
        if errors and not body_failed:
            raise errors[0]
