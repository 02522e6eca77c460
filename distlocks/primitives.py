"""Semaphores and read-write locks: :func:`semaphore`, :func:`rwlock` and their
asyncio forms :func:`asemaphore` and :func:`arwlock`.

Their leases are the lock's own :class:`~distlocks.lease.Lease` and
:class:`~distlocks.lease.AsyncLease`, acquired by the lock's own waiting loop and
renewed by the same watchdog, so expiry, renewal and a loud loss behave exactly as
for :func:`~distlocks.lock`. What differs is only the server call, so each
primitive hands the lock machinery a :class:`PermitServer`: the backend seen
through the lock-backend calls, for one kind of permit.

* A semaphore lets at most ``limit`` holders in at once. Each permit has its own
  lease, so a crashed holder's permit comes back when its lease runs out (at once
  on PostgreSQL, where it ends with the connection). Each acquisition is judged by
  its own ``limit``: keep one limit per name.
* A read-write lock lets many readers or one writer in. A writer that waits holds
  up new readers, so a stream of readers cannot starve it. Write leases carry a
  fencing token, strictly increasing per read-write lock name; read leases and
  semaphore permits carry 0, which a fenced row already written under a lock
  rejects, so a shared lease cannot pass for an exclusive one.

The names are apart from plain locks: ``rwlock("x")``, ``semaphore("x", ...)``
and ``lock("x")`` are three different things.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Generic, ParamSpec, TypeVar

from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
)
from distlocks.backends.capabilities import Permits, require
from distlocks.exceptions import LockNotAcquired
from distlocks.handler import backends, check_alias
from distlocks.lease import AsyncLease, Lease
from distlocks.locks import _DEFAULT, AsyncLock, Lock, _LockBase, aacquire_lease, acquire_lease
from distlocks.logs import log_expected
from distlocks.validation import MAX_SEMAPHORE_LIMIT, validate_name, validate_timeout

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def validate_limit(limit: Any) -> int:
    """A semaphore's number of permits: an int >= 1."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(
            f"limit must be an int number of permits (>= 1), not {type(limit).__name__}: {limit!r}."
        )
    if limit < 1:
        raise ValueError(f"limit must be at least 1 permit, not {limit}.")
    if limit > MAX_SEMAPHORE_LIMIT:
        raise ValueError(
            f"limit must be at most {MAX_SEMAPHORE_LIMIT:,} permits, not "
            f"{limit if limit < 10**12 else 'a number of ' + str(len(str(limit))) + ' digits'}."
        )
    return limit


class PermitServer:
    """A backend seen through the lock-backend calls, for one kind of permit.

    The acquisition loop and the leases call ``acquire``/``release``/``extend``...
    as on a lock backend; this forwards them to the backend's ``permit_*`` methods
    with the kind (and the semaphore's limit).
    """

    def __init__(self, backend: BaseBackend, kind: str, limit: int = 1) -> None:
        self.backend: Permits = require(backend, Permits, kind)
        self.kind = kind
        self.limit = limit
        self.alias = backend.alias
        self.wakes_on_release = self.backend.permit_wakes_on_release(kind)
        self.expires_on_server = backend.expires_on_server

    def __repr__(self) -> str:
        return f"<PermitServer {self.kind} on {self.alias!r}>"

    def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        return self.backend.permit_acquire(
            self.kind, name, owner, ttl, holder, limit=self.limit, wait=wait
        )

    def release(self, name: str, owner: str) -> bool:
        return self.backend.permit_release(self.kind, name, owner)

    def release_quietly(self, name: str, owner: str) -> bool:
        try:
            return self.release(name, owner)
        except Exception as exc:
            log_expected(logger, exc, "Could not give back a %s permit of %r on backend %r",
                         self.kind, name, self.alias)  # fmt: skip
            return False

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        return self.backend.permit_extend(self.kind, name, owner, ttl)

    def local_lease(self, ttl: float) -> float:
        return self.backend.local_lease(ttl)

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        self.backend.permit_wait(self.kind, name, timeout, owner=owner, limit=self.limit)

    def leave_queue(self, name: str, owner: str) -> None:
        self.backend.permit_leave(self.kind, name, owner)

    async def aacquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        return await self.backend.apermit_acquire(
            self.kind, name, owner, ttl, holder, limit=self.limit, wait=wait
        )

    async def arelease(self, name: str, owner: str) -> bool:
        return await self.backend.apermit_release(self.kind, name, owner)

    async def arelease_quietly(self, name: str, owner: str) -> bool:
        try:
            return await self.arelease(name, owner)
        except Exception as exc:
            log_expected(logger, exc, "Could not give back a %s permit of %r on backend %r",
                         self.kind, name, self.alias)  # fmt: skip
            return False

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        return await self.backend.apermit_extend(self.kind, name, owner, ttl)

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        await self.backend.apermit_wait(self.kind, name, timeout, owner=owner, limit=self.limit)

    async def aleave_queue(self, name: str, owner: str) -> None:
        await self.backend.apermit_leave(self.kind, name, owner)


_WHAT = {SEMAPHORE: "semaphore()", READ: "rwlock().read()", WRITE: "rwlock().write()"}
_ASYNC_WHAT = {SEMAPHORE: "asemaphore()", READ: "arwlock().read()", WRITE: "arwlock().write()"}


class _PermitBase(_LockBase):
    """Arguments shared by the sync and async permit objects: those of a lock that
    apply (``ttl``, ``timeout``, ``auto_renew``, ``max_hold``, ``on_lost``), the
    kind, and a semaphore's ``limit``. No ``reentrant`` or ``fair``."""

    def __init__(
        self,
        name: str,
        *,
        kind: str,
        limit: int = 1,
        backend: str = "default",
        ttl: float | None = None,
        timeout: float | None = _DEFAULT,
        auto_renew: bool = True,
        max_hold: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
    ) -> None:
        super().__init__(
            name,
            backend=backend,
            ttl=ttl,
            timeout=timeout,
            auto_renew=auto_renew,
            max_hold=max_hold,
            on_lost=on_lost,
        )
        if kind not in _WHAT:
            raise ValueError(f"kind must be 'semaphore', 'read' or 'write', not {kind!r}.")
        self.kind = kind
        self.limit = validate_limit(limit) if kind == SEMAPHORE else 1
        # A backend without this primitive is a configuration error: say so at the call.
        require(self.backend, Permits, kind)

    def __repr__(self) -> str:
        limit = f" limit={self.limit}" if self.kind == SEMAPHORE else ""
        return (
            f"<{type(self).__name__} {self.kind} {self.name!r}{limit} "
            f"backend={self.backend_alias!r}>"
        )

    def _server(self) -> PermitServer:
        return PermitServer(self.backend, self.kind, self.limit)

    def _wait(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is _DEFAULT else validate_timeout(timeout)

    def _explain(self, exc: LockNotAcquired) -> None:
        """Reword ``exc`` to say what was busy, in the primitive's own words."""
        if self.kind == SEMAPHORE:
            what = f"a permit of semaphore {self.name!r}"
            busy = f"all {self.limit} permits were held"
        elif self.kind == READ:
            what = f"a read lease of read-write lock {self.name!r}"
            busy = "a writer held it or was waiting for it"
        else:
            what = f"the write lease of read-write lock {self.name!r}"
            busy = "readers or a writer held it"
        if exc.timeout == 0:
            detail = f"{busy} (timeout=0: tried once)"
        else:
            detail = f"{busy} throughout the {exc.timeout:g}s wait"
        exc.args = (f"Could not acquire {what} on backend {exc.backend!r}: {detail}.",)

    def holders(self) -> list[LockInfo]:
        """The live permits of this semaphore or read-write lock, from the server."""
        return require(self.backend, Permits, self.kind).permit_holders(self.kind, self.name)


class PermitLock(_PermitBase, Lock):
    """A semaphore permit or one side of a read-write lock: a context manager, a
    decorator, or explicit ``acquire()``, exactly like :class:`~distlocks.locks.Lock`."""

    def acquire(self, *, timeout: float | None = _DEFAULT) -> Lease:
        """Acquire a lease, waiting up to ``timeout`` seconds (default: the object's).

        Raises :class:`LockNotAcquired` when there was no room in time,
        :class:`LockBackendUnavailable` when the server cannot be reached.
        """
        try:
            return acquire_lease(
                self._server(), self.name, ttl=self.ttl, timeout=self._wait(timeout),
                **self._options(),
            )  # fmt: skip
        except LockNotAcquired as exc:
            self._explain(exc)
            raise

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"{_WHAT[self.kind]} cannot decorate the coroutine function "
                f"{func.__qualname__}; use {_ASYNC_WHAT[self.kind]} for async code."
            )
        if inspect.isgeneratorfunction(func):
            raise TypeError(
                f"{_WHAT[self.kind]} cannot decorate the generator function "
                f"{func.__qualname__}: the lease would be held only while the generator "
                f"is created. Take it inside the generator."
            )
        return super().__call__(func)


class AsyncPermitLock(_PermitBase, AsyncLock):
    """The asyncio form of :class:`PermitLock` (``async with``, coroutine decorator,
    ``await acquire()``)."""

    async def acquire(self, *, timeout: float | None = _DEFAULT) -> AsyncLease:
        """Acquire a lease, waiting up to ``timeout`` seconds without blocking the loop."""
        try:
            return await aacquire_lease(
                self._server(), self.name, ttl=self.ttl, timeout=self._wait(timeout),
                **self._options(),
            )  # fmt: skip
        except LockNotAcquired as exc:
            self._explain(exc)
            raise

    def __call__(
        self, func: Callable[..., Coroutine[Any, Any, Any]]
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"{_ASYNC_WHAT[self.kind]} decorates coroutine functions; "
                f"{func.__qualname__} is not one. Use {_WHAT[self.kind]} for plain functions."
            )
        return super().__call__(func)


S = TypeVar("S", PermitLock, AsyncPermitLock)


def semaphore(
    name: str,
    *,
    limit: int,
    backend: str = "default",
    ttl: float | None = None,
    timeout: float | None = _DEFAULT,
    auto_renew: bool = True,
    max_hold: float | None = None,
    on_lost: Callable[[Any], object] | None = None,
) -> PermitLock:
    """A semaphore of ``limit`` permits on ``name``; each ``with`` or call takes one.

    ``ttl``, ``timeout``, ``auto_renew``, ``max_hold`` and ``on_lost`` are as for
    :func:`~distlocks.lock`. Each acquisition is admitted by its own ``limit``.
    """
    return PermitLock(
        name, kind=SEMAPHORE, limit=limit, backend=backend, ttl=ttl, timeout=timeout,
        auto_renew=auto_renew, max_hold=max_hold, on_lost=on_lost,
    )  # fmt: skip


def asemaphore(
    name: str,
    *,
    limit: int,
    backend: str = "default",
    ttl: float | None = None,
    timeout: float | None = _DEFAULT,
    auto_renew: bool = True,
    max_hold: float | None = None,
    on_lost: Callable[[Any], object] | None = None,
) -> AsyncPermitLock:
    """The asyncio form of :func:`semaphore`."""
    return AsyncPermitLock(
        name, kind=SEMAPHORE, limit=limit, backend=backend, ttl=ttl, timeout=timeout,
        auto_renew=auto_renew, max_hold=max_hold, on_lost=on_lost,
    )  # fmt: skip


class _RWLockBase(Generic[S]):
    """A read-write lock on ``name``: ``.read(...)`` for a shared lease, ``.write(...)``
    for the exclusive, fenced one."""

    _side: type[S]

    def __init__(self, name: str, *, backend: str = "default") -> None:
        self.name = validate_name(name)
        check_alias(backend)
        self.backend_alias = backend
        require(self.backend, Permits, READ)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} backend={self.backend_alias!r}>"

    @property
    def backend(self) -> BaseBackend:
        return backends[self.backend_alias]

    def read(
        self,
        *,
        ttl: float | None = None,
        timeout: float | None = _DEFAULT,
        auto_renew: bool = True,
        max_hold: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
    ) -> S:
        """The shared side: many readers at once, none while a writer holds or waits.
        Arguments as for :func:`~distlocks.lock`."""
        return self._side(
            self.name, kind=READ, backend=self.backend_alias, ttl=ttl, timeout=timeout,
            auto_renew=auto_renew, max_hold=max_hold, on_lost=on_lost,
        )  # fmt: skip

    def write(
        self,
        *,
        ttl: float | None = None,
        timeout: float | None = _DEFAULT,
        auto_renew: bool = True,
        max_hold: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
    ) -> S:
        """The exclusive side: one writer, no readers; its lease carries a fencing token.
        Arguments as for :func:`~distlocks.lock`."""
        return self._side(
            self.name, kind=WRITE, backend=self.backend_alias, ttl=ttl, timeout=timeout,
            auto_renew=auto_renew, max_hold=max_hold, on_lost=on_lost,
        )  # fmt: skip

    def holders(self) -> list[LockInfo]:
        """The live read and write leases, from the server (``extra["kind"]`` says which)."""
        return require(self.backend, Permits, RWLOCK).permit_holders(RWLOCK, self.name)

    def fencing_counter(self) -> int:
        """The last write token issued for this read-write lock (0 if none yet)."""
        return require(self.backend, Permits, WRITE).permit_counter(self.name)


class RWLock(_RWLockBase[PermitLock]):
    """A read-write lock (blocking API). Built as ``rwlock(name, backend=...)``."""

    _side = PermitLock


class AsyncRWLock(_RWLockBase[AsyncPermitLock]):
    """The asyncio read-write lock: ``async with arwlock(name).read(...)``."""

    _side = AsyncPermitLock


#: ``rwlock(name, backend=...)``: build a :class:`RWLock` (the public spelling).
rwlock = RWLock
#: ``arwlock(name, backend=...)``: build an :class:`AsyncRWLock` (the public spelling).
arwlock = AsyncRWLock
