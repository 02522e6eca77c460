"""What some backends can do beyond the lock operations: capabilities a backend declares.

:class:`~distlocks.backends.base.BaseBackend` requires only what every backend has
(acquire, release, extend, inspect, force_release, fencing_counter). A backend that can
do more inherits the capability, which brings its methods, their defaults and their
async forms::

    class ConsulBackend(Listing, Waiting, BaseBackend): ...

:class:`Listing`
    It can list its live locks (``iter_locks``): the admin page of live locks, the
    ``distlocks list`` command and the metrics show them.
:class:`Waiting`
    A waiter blocks in ``wait()`` until a release wakes it (``wakes_on_release``), and
    can leave a wait queue. Without it the lock layer polls, with a growing pause
    (:data:`POLLING`): correct, only slower to see a release.
:class:`Permits`
    Semaphores and read-write locks (``permit_kinds`` and the ``permit_*`` methods).

Whoever needs a capability asks :func:`require`, the one place that says, where a
backend lacks it, which backend, what it lacks and what to use instead
(:func:`not_supported`); nothing checks ``hasattr`` or calls a stub. A class that
writes a capability's methods without declaring it is refused when it is made (see
``BaseBackend.__init_subclass__``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
    WaitServer,
    permit_family,
)

logger = logging.getLogger(__name__)
C = TypeVar("C", bound=BaseBackend)

_PLURALS = {SEMAPHORE: "semaphores", RWLOCK: "read-write locks"}


class Listing(BaseBackend):
    """The capability to list every live lock of the backend, for the admin page of
    live locks, ``distlocks list`` and the metrics."""

    #: The methods that belong to this capability (a class writing one declares it).
    methods: ClassVar[frozenset[str]] = frozenset({"iter_locks", "iter_permits"})
    #: The class attributes that belong to it (a class setting one declares it).
    attributes: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def iter_locks(self) -> Iterator[LockInfo]:
        """Yield every live lock on this backend, and with :class:`Permits` every live
        permit too (``extra["kind"]`` says which)."""

    def iter_permits(self) -> Iterator[LockInfo]:
        """Yield every live permit on this backend (nothing, where there are none)."""
        return iter(())


class Waiting(BaseBackend):
    """The capability to wake waiters: :meth:`wait` returns when ``name`` may have been
    freed, and a waiter registered by ``acquire(wait=...)`` can leave the queue.

    A backend without it is polled by the lock layer (:data:`POLLING`)."""

    methods: ClassVar[frozenset[str]] = frozenset(
        {"wait", "leave_queue", "await_release", "aleave_queue"}
    )
    attributes: ClassVar[frozenset[str]] = frozenset({"wakes_on_release"})
    #: True when :meth:`wait` returns as soon as the lock is released (the lock layer
    #: then waits as long as the holder's lease allows); False to be polled with a
    #: growing pause between calls of :meth:`wait`.
    wakes_on_release: ClassVar[bool] = True

    @abstractmethod
    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        """Block up to ``timeout`` seconds, or less when ``name`` may have been freed (for
        a ``fair`` waiter: when it may be ``owner``'s turn). Returning early is harmless;
        blocking longer than ``timeout`` is not."""

    def leave_queue(self, name: str, owner: str) -> None:
        """``owner`` stopped waiting for ``name`` (timeout or error): forget it, so it
        does not hold up the waiters behind it."""

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        """Async :meth:`wait`."""
        await self._in_thread(True, self.wait, name, timeout, owner=owner, fair=fair)

    async def aleave_queue(self, name: str, owner: str) -> None:
        """Async :meth:`leave_queue`."""
        await self._in_thread(False, self.leave_queue, name, owner)

    def _give_back_lock(
        self, name: str, owner: str, wait: float, result: AcquireResult | None
    ) -> None:
        """Also leave the wait queue a cancelled acquisition may have joined (after it
        has finished, so the registration cannot come back behind the leave)."""
        super()._give_back_lock(name, owner, wait, result)
        if wait > 0:
            self.leave_queue(name, owner)


class Permits(BaseBackend):
    """The capability of semaphores and read-write locks.

    A backend lists the kinds it serves in :attr:`permit_kinds` and writes the
    ``permit_*`` operations, each one atomic step; ``permit_wait``/``permit_leave`` only
    if it can wake waiters (by default they poll). Permits of one name are apart from
    the plain lock of that name and from the other primitive.
    """

    methods: ClassVar[frozenset[str]] = frozenset(
        {
            "permit_acquire", "permit_release", "permit_extend", "permit_wait",
            "permit_leave", "permit_holders", "permit_force_release", "permit_counter",
            "permit_wakes_on_release", "apermit_acquire", "apermit_release",
            "apermit_extend", "apermit_wait", "apermit_leave",
        }
    )  # fmt: skip
    attributes: ClassVar[frozenset[str]] = frozenset({"permit_kinds"})
    #: The permit kinds (``"semaphore"``, ``"read"``, ``"write"``) this backend serves
    #: (an instance may narrow them: PostgreSQL has none in transaction mode).
    permit_kinds: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse ``permit_kinds`` that cannot be served: a misspelt kind would never be
        served and never be reported, and a read-write lock needs both of its sides."""
        super().__init_subclass__(**kwargs)
        kinds = cls.__dict__.get("permit_kinds")
        if kinds is None or isinstance(kinds, property):  # inherited, or per instance
            return
        problem = ""
        if not isinstance(kinds, frozenset | set):
            problem = f"must be a frozenset of kinds, not {type(kinds).__name__}"
        elif unknown := sorted(map(repr, set(kinds) - {SEMAPHORE, READ, WRITE})):
            problem = f"has unknown kind(s) {', '.join(unknown)}"
        elif (READ in kinds) != (WRITE in kinds):
            problem = (
                "must have both 'read' and 'write' (the sides of a read-write lock) or neither"
            )
        if problem:
            raise TypeError(
                f"{cls.__qualname__}.permit_kinds = {kinds!r} {problem}: use a frozenset of "
                f"'semaphore', 'read' and 'write'."
            )

    def unsupported(self, kind: str) -> NotSupported:
        """The error for a permit kind this backend does not serve (to raise)."""
        return not_supported(self, Permits, kind)

    def check_permit_kind(self, kind: str) -> None:
        """Raise :meth:`unsupported` unless this backend serves ``kind`` (a read-write
        lock as a whole, ``"rwlock"``, is served when its read side is)."""
        if (READ if kind == RWLOCK else kind) not in self.permit_kinds:
            raise self.unsupported(kind)

    @abstractmethod
    def permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        limit: int = 1,
        wait: float = 0.0,
    ) -> AcquireResult:
        """Take a permit of ``kind`` on ``name`` for ``owner`` in one atomic step, if
        there is room: fewer than ``limit`` live semaphore permits; no writer holding
        or waiting, for a reader; nobody holding, for a writer (which gets a fencing
        token above every earlier write token of ``name``; other permits get 0).

        Acquiring again with the same ``owner`` returns the same permit (retry-safe).
        ``wait`` > 0 says the caller will wait up to that long (a waiting writer holds
        up new readers while it is registered). When refused, ``remaining`` says when
        the permit that blocks it ends at the latest (None: unknown)."""

    @abstractmethod
    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        """Give back ``owner``'s permit only; True if this call gave it back."""

    @abstractmethod
    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        """Reset ``owner``'s permit to ``ttl`` seconds; False if it no longer has it."""

    @abstractmethod
    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        """The live permits of the semaphore or read-write lock ``name`` (``kind`` is
        one of its kinds or ``"rwlock"``), one :class:`LockInfo` each, with
        ``extra["kind"]`` set to ``"semaphore"``, ``"read"`` or ``"write"``."""

    @abstractmethod
    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        """Evict ``owner``'s permit on ``name`` (every permit when None), whoever holds
        it; for a read-write lock the write counter moves on, so an evicted writer's
        fenced writes are rejected. Returns how many live permits were evicted."""

    @abstractmethod
    def permit_counter(self, name: str) -> int:
        """The last write token issued for the read-write lock ``name`` (0 if none)."""

    def permit_wakes_on_release(self, kind: str) -> bool:
        """True when :meth:`permit_wait` returns as soon as a permit may be free (by
        default: when the backend writes its own :meth:`permit_wait` and wakes the
        waiters of its locks). The default :meth:`permit_wait` only sleeps: a waiter on
        it must be polled, not left asleep until the holder's lease ends."""
        if type(self).permit_wait is Permits.permit_wait:
            return False
        return isinstance(self, Waiting) and self.wakes_on_release

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        """Block up to ``timeout`` seconds, or less when a permit may have come free
        (``limit``: the semaphore's, as the caller asked).

        The default sleeps (the caller polls with a growing interval)."""
        self.check_permit_kind(kind)
        time.sleep(max(0.0, timeout))

    def permit_leave(self, kind: str, name: str, owner: str) -> None:
        """``owner`` stopped waiting (timeout or error): forget its registration."""

    def force_release_holder(self, info: LockInfo) -> bool:
        """Evict the holder ``info`` describes: a plain lock by name, a permit by its
        owner. True if it was still held."""
        kind = info.extra.get("kind")
        if kind in (SEMAPHORE, READ, WRITE):
            return self.permit_force_release(str(kind), info.name, info.owner) > 0
        return super().force_release_holder(info)

    async def apermit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        limit: int = 1,
        wait: float = 0.0,
    ) -> AcquireResult:
        """Async :meth:`permit_acquire`. If the caller is cancelled while a worker
        thread is acquiring, the permit it takes is given back when it finishes."""
        give_back = functools.partial(self._give_back_permit, kind, name, owner, wait)
        return await self._take_in_thread(
            wait > 0, give_back, self.permit_acquire, kind, name, owner, ttl, holder,
            limit=limit, wait=wait,
        )  # fmt: skip

    def _give_back_permit(
        self, kind: str, name: str, owner: str, wait: float, result: AcquireResult | None
    ) -> None:
        """Undo a cancelled :meth:`apermit_acquire` whose thread went on (as
        ``_give_back_lock`` does for a lock)."""
        if result is not None and result.acquired:
            logger.debug("Giving back a %s permit of %r (owner %r) on backend %r: its "
                         "acquirer was cancelled", kind, name, owner, self.alias)  # fmt: skip
            try:
                self.permit_release(kind, name, owner)
            except Exception:
                logger.warning("Could not give back a %s permit of %r on backend %r",
                               kind, name, self.alias, exc_info=True)  # fmt: skip
        if wait > 0:
            self.permit_leave(kind, name, owner)

    async def apermit_release(self, kind: str, name: str, owner: str) -> bool:
        """Async :meth:`permit_release`."""
        return await self._in_thread(False, self.permit_release, kind, name, owner)

    async def apermit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        """Async :meth:`permit_extend`."""
        return await self._in_thread(False, self.permit_extend, kind, name, owner, ttl)

    async def apermit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        """Async :meth:`permit_wait` (the default sleeps without blocking the loop)."""
        if type(self).permit_wait is Permits.permit_wait:
            self.check_permit_kind(kind)
            await asyncio.sleep(max(0.0, timeout))
            return
        await self._in_thread(True, self.permit_wait, kind, name, timeout, owner=owner, limit=limit)

    async def apermit_leave(self, kind: str, name: str, owner: str) -> None:
        """Async :meth:`permit_leave`."""
        await self._in_thread(False, self.permit_leave, kind, name, owner)


#: Every capability, in the order a backend's bases usually name them.
CAPABILITIES: list[type] = [Listing, Waiting, Permits]


# -- the one answer where a capability is missing ----------------------------------------


class NotSupported(ImproperlyConfigured):
    """A backend lacks a capability (or a permit kind) the caller needs: a configuration
    error (use another backend for it), told in the words of :func:`not_supported`."""


#: What the built-in backends offer, for "use instead" (the same words as the docs).
_WHO_HAS = {
    Listing: "Redis, Redlock, PostgreSQL, etcd, ZooKeeper, or LocMem in tests",
    Permits: "Redis, PostgreSQL in session mode, etcd, ZooKeeper, or LocMem in tests",
    Waiting: "Redis, Redlock, PostgreSQL, etcd, ZooKeeper, or LocMem in tests",
}


def not_supported(backend: BaseBackend, capability: type, kind: str | None = None) -> NotSupported:
    """The error (to raise) for ``backend`` lacking ``capability`` (for :class:`Permits`,
    or the permit ``kind`` it asked for): which backend, what it lacks, what to use
    instead. The one wording of every "not supported" answer."""
    _check_capability(capability)
    which = f"Backend {backend.alias!r} ({type(backend).__name__})"
    if not isinstance(backend, capability):
        how = f"it does not declare the {capability.__name__} capability"
    elif isinstance(backend, Permits) and capability is Permits:
        kinds = ", ".join(sorted(backend.permit_kinds))
        how = f"it serves {kinds} permits only" if kinds else "it serves none as configured"
    else:
        raise ValueError(f"{which} declares {capability.__name__}: nothing is missing.")
    if capability is Permits:
        what = _PLURALS[permit_family(kind or SEMAPHORE)]
        return NotSupported(
            f"{which} does not support {what} ({how}). Use a backend that does "
            f"({_WHO_HAS[Permits]}) for them: pass backend=<its alias>."
        )
    if capability is Listing:
        return NotSupported(
            f"{which} cannot list its locks ({how}): the live-locks page, "
            f"`distlocks list` and the metrics leave it out. One lock is still read by "
            f"name (`distlocks inspect NAME --backend {backend.alias}`); to list them, "
            f"use a backend that can ({_WHO_HAS[Listing]})."
        )
    if capability is Waiting:
        return NotSupported(
            f"{which} does not wake waiters ({how}): the lock layer polls it, which is "
            f"correct, only slower to see a release. For wake-ups, use a backend that "
            f"has them ({_WHO_HAS[Waiting]}): pass backend=<its alias>."
        )
    raise AssertionError(capability)  # _check_capability() let through no other


def _check_capability(capability: object) -> None:
    if capability not in CAPABILITIES:
        raise ValueError(
            f"{capability!r} is not a backend capability; use one of "
            f"{', '.join(c.__name__ for c in CAPABILITIES)}."
        )


def unwritten(cls: type[BaseBackend]) -> str:
    """What ``cls`` declares but does not write (its abstract methods, by the capability
    or the base class that asks for them), as one sentence; "" when it writes it all.
    Said when the class is named in settings, not at its first use deep in a request."""
    missing: dict[str, list[str]] = {}
    for method in sorted(getattr(cls, "__abstractmethods__", ())):
        owner = next(
            (k for k in (*CAPABILITIES, BaseBackend) if method in vars(k) and issubclass(cls, k)),
            None,
        )
        what = "" if owner is None else owner.__name__
        missing.setdefault(what, []).append(f"{method}()")
    parts = []
    for what, methods in missing.items():
        listed = ", ".join(methods)
        if what == BaseBackend.__name__:
            parts.append(f"does not write {listed}, required of every backend")
        elif what:
            parts.append(f"declares the {what} capability but does not write {listed}")
        else:
            parts.append(f"leaves {listed} abstract")
    return f"{cls.__qualname__} {'; it '.join(parts)}." if parts else ""


# ``capability`` is typed as a callable returning C, not ``type[C]``: mypy refuses an
# abstract class (each capability is one) where ``type[C]`` is expected.
def require(backend: BaseBackend, capability: Callable[..., C], kind: str | None = None) -> C:
    """``backend`` as ``capability`` if it declares it (and, for :class:`Permits` with a
    ``kind``, serves that kind); else the one clear answer of :func:`not_supported`,
    raised as :class:`NotSupported` (an ``ImproperlyConfigured``)."""
    _check_capability(capability)
    declared = cast(type, capability)
    if not isinstance(backend, declared):
        if kind is not None:
            permit_family(kind)  # an unknown kind is a ValueError, not "unsupported"
        raise not_supported(backend, declared, kind)
    if kind is not None and isinstance(backend, Permits):
        backend.check_permit_kind(kind)
    return cast(C, backend)


# -- waiting, for a backend with or without the capability ------------------------------


class _Polling:
    """How the lock layer waits on a backend without :class:`Waiting`: it sleeps, and
    (``wakes_on_release`` False) grows the pause between two attempts."""

    wakes_on_release = False

    def __repr__(self) -> str:
        return "POLLING"

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        time.sleep(max(0.0, timeout))

    def leave_queue(self, name: str, owner: str) -> None:
        """Nothing was registered."""

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        await asyncio.sleep(max(0.0, timeout))

    async def aleave_queue(self, name: str, owner: str) -> None:
        """Nothing was registered."""


#: The waiting side of every backend that does not declare :class:`Waiting`.
POLLING = _Polling()


def waiting_side(server: object) -> WaitServer:
    """What the acquisition loop waits on for ``server``: the server itself where it
    waits (a backend with :class:`Waiting`, a permit view), else :data:`POLLING`."""
    if isinstance(server, BaseBackend) and not isinstance(server, Waiting):
        return POLLING
    return cast(WaitServer, server)
