"""The contract every lock backend fulfils.

A backend is a thin, stateless-per-call adapter over one lock server. All the
lease bookkeeping (deadlines, loss detection, signals) lives in
:mod:`distlocks.lease`; a backend only has to make each operation below one
atomic step on its server.

This module holds what every backend has: the data a backend returns
(:class:`Holder`, :class:`AcquireResult`, :class:`LockInfo`), the protocols the
leases and the waiting loop call on, and :class:`BaseBackend` with its required
operations and its optional hooks. What only some backends have (listing their
locks, waking waiters, semaphores and read-write locks) is a capability a backend
declares by inheriting it, in :mod:`distlocks.backends.capabilities`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import difflib
import functools
import importlib
import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from django.core.checks import CheckMessage, Error

from distlocks.exceptions import LockError
from distlocks.logs import log_expected

logger = logging.getLogger(__name__)
T = TypeVar("T")
_executor_lock = threading.Lock()

#: Kinds of permit (leases of the primitives other than a plain lock): a semaphore
#: permit, and the shared and exclusive sides of a read-write lock.
SEMAPHORE = "semaphore"
READ = "read"
WRITE = "write"
#: Both sides of a read-write lock, where holders are listed or evicted together.
RWLOCK = "rwlock"
_FAMILIES = {SEMAPHORE: SEMAPHORE, READ: RWLOCK, WRITE: RWLOCK, RWLOCK: RWLOCK}


def permit_family(kind: str) -> str:
    """``"semaphore"`` or ``"rwlock"`` for a permit kind; ValueError for anything else."""
    try:
        return _FAMILIES[kind]
    except KeyError:
        raise ValueError(
            f"Unknown permit kind {kind!r}; use 'semaphore', 'read', 'write' or 'rwlock'."
        ) from None


def holder_details(value: Any) -> dict[str, Any]:
    """A holder's extra details as a dict, from whatever a server holds (JSON text, or
    a value its driver decoded): a lock written by another program, another version
    or by hand may have anything there. Unreadable text gives ``{}``; a value that is
    not an object is kept under ``"value"``. A listing then shows the lock instead of
    failing for every lock of the backend."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode(errors="replace")
    if isinstance(value, str):
        if not value or value == "{}":
            return {}
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(key): item for key, item in value.items()}
    return {"value": value}


def moment(start: dt.datetime, milliseconds: float) -> dt.datetime | None:
    """``start`` plus ``milliseconds``; None when that is no representable date (a lock
    written by another program, or before the ttl bound): a listing then shows the
    lock with an unknown time rather than failing for every lock of the backend."""
    try:
        return start + dt.timedelta(milliseconds=milliseconds)
    except (OverflowError, ValueError):
        return None


@dataclass(frozen=True)
class Holder:
    """Who is asking for a lock, recorded next to it for inspection."""

    host: str
    pid: int
    thread: str
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AcquireResult:
    """What one acquisition attempt returned."""

    acquired: bool
    #: The fencing token of the new lease (0 when not acquired).
    fencing_token: int = 0
    #: Seconds the lease (or, when not acquired, the current holder's lease) has left;
    #: ``None`` when the backend has no expiry.
    remaining: float | None = None


@dataclass(frozen=True)
class LockInfo:
    """A live lock as seen by the server, for the admin page and the CLI."""

    name: str
    backend: str
    owner: str
    fencing_token: int
    host: str = ""
    pid: int | None = None
    thread: str = ""
    acquired_at: dt.datetime | None = None
    expires_at: dt.datetime | None = None
    ttl: float | None = None
    renewals: int = 0
    waiters: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def held_for(self) -> dt.timedelta | None:
        if self.acquired_at is None:
            return None
        return dt.datetime.now(dt.UTC) - self.acquired_at

    @property
    def expires_in(self) -> dt.timedelta | None:
        if self.expires_at is None:
            return None
        return self.expires_at - dt.datetime.now(dt.UTC)


class LeaseServer(Protocol):
    """What a lease and the acquisition loop call on: a backend (for plain locks), or a
    backend's view of one kind of permit (:class:`distlocks.primitives.PermitServer`)."""

    @property
    def alias(self) -> str: ...

    @property
    def expires_on_server(self) -> bool: ...

    def acquire(
        self, name: str, owner: str, ttl: float, holder: Holder, *, wait: float = ...,
        fair: bool = ...,
    ) -> AcquireResult: ...  # fmt: skip

    def release(self, name: str, owner: str) -> bool: ...

    def release_quietly(self, name: str, owner: str) -> bool: ...

    def extend(self, name: str, owner: str, ttl: float) -> bool: ...

    def local_lease(self, ttl: float) -> float: ...

    async def aacquire(
        self, name: str, owner: str, ttl: float, holder: Holder, *, wait: float = ...,
        fair: bool = ...,
    ) -> AcquireResult: ...  # fmt: skip

    async def arelease(self, name: str, owner: str) -> bool: ...

    async def arelease_quietly(self, name: str, owner: str) -> bool: ...

    async def aextend(self, name: str, owner: str, ttl: float) -> bool: ...


class WaitServer(Protocol):
    """What the acquisition loop waits on between two attempts: a backend that declares
    :class:`~distlocks.backends.capabilities.Waiting`, a permit view, or, for a backend
    without it, :data:`~distlocks.backends.capabilities.POLLING` (see
    :func:`~distlocks.backends.capabilities.waiting_side`)."""

    @property
    def wakes_on_release(self) -> bool: ...

    def wait(self, name: str, timeout: float, *, owner: str = ..., fair: bool = ...) -> None: ...

    def leave_queue(self, name: str, owner: str) -> None: ...

    async def await_release(
        self, name: str, timeout: float, *, owner: str = ..., fair: bool = ...
    ) -> None: ...

    async def aleave_queue(self, name: str, owner: str) -> None: ...


def unknown_options(backend: str, options: Mapping[Any, Any], known: frozenset[str]) -> list[str]:
    """One problem per ``OPTIONS`` key ``backend`` does not read, with the closest
    known key as a hint ("did you mean ..."); none when every key is known."""
    problems = []
    for key in sorted(set(options) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(
            f"unknown OPTIONS key {key!r} ({hint}{backend} reads {', '.join(sorted(known))})"
        )
    return problems


def _refuse_hidden_methods(cls: type) -> None:
    """Refuse a class whose bases put an abstract method (of BaseBackend or of a
    capability) in front of a class that writes it, a mixin named after the capability
    it implements: the written one would never be found, and the class would only be
    found abstract when it is first used."""
    for name in dir(cls):
        first = next((k for k in cls.__mro__ if name in vars(k)), None)
        if first is None or not getattr(vars(first)[name], "__isabstractmethod__", False):
            continue
        later = cls.__mro__[cls.__mro__.index(first) + 1 :]
        hidden = next(
            (
                k
                for k in later
                if name in vars(k) and not getattr(vars(k)[name], "__isabstractmethod__", False)
            ),
            None,
        )
        if hidden is not None:
            raise TypeError(
                f"{cls.__qualname__}: the abstract {first.__name__}.{name}() hides "
                f"{hidden.__qualname__}.{name}(), which would never be called: name "
                f"{hidden.__name__} before {first.__name__} in the bases of "
                f"{cls.__name__} (or of the class that names both)."
            )


class BaseBackend(ABC):
    """Base class of lock backends: the operations every backend must have.

    Subclasses are created by :mod:`distlocks.handler` from one entry of
    ``DISTLOCKS_BACKENDS``; ``config`` is that entry as written in settings. A backend
    that can do more declares it by also inheriting a capability of
    :mod:`distlocks.backends.capabilities` (``Listing``, ``Waiting``, ``Permits``).
    """

    #: False when every call returns at once (an in-process backend): the async
    #: methods then run inline instead of in a worker thread.
    calls_block: ClassVar[bool] = True
    #: Config keys this backend understands, besides ``BACKEND``.
    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS"})
    #: The ``OPTIONS`` keys this backend reads; any other key is refused (a misspelt
    #: option must not be silently ignored). None: the backend checks them itself.
    option_keys: ClassVar[frozenset[str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a class that has a capability's methods or settings without declaring
        the capability: nothing would ever call them (the live-locks page would say it
        cannot list, waiters would poll), and nobody would be told why. They count
        wherever the class gets them: written in it, or from a mixin of no capability."""
        super().__init_subclass__(**kwargs)
        # Imported here: the capabilities are subclasses of this class. While that
        # module is still being made (defining the capabilities themselves), it has no
        # CAPABILITIES yet and nothing is checked.
        module = importlib.import_module("distlocks.backends.capabilities")
        for capability in getattr(module, "CAPABILITIES", ()):
            # Not issubclass(): ABCMeta's cache of a class of the same id, gone since,
            # may answer for a class that is not even finished.
            if capability in cls.__mro__:
                continue
            # No class of the MRO is the capability: whatever defines one of its
            # names is the class itself, a backend that was checked, or a mixin.
            found = {
                attr: klass
                for klass in reversed(cls.__mro__)
                for attr in vars(klass)
                if attr in capability.methods or attr in capability.attributes
            }
            if found:
                names = [
                    attr + ("()" if attr in capability.methods else "")
                    + ("" if klass is cls else f" (from {klass.__qualname__})")
                    for attr, klass in sorted(found.items())
                ]  # fmt: skip
                raise TypeError(
                    f"{cls.__qualname__} defines {', '.join(names)} but does not declare "
                    f"the {capability.__name__} capability, so nothing would use "
                    f"{'them' if len(names) > 1 else 'it'}: add "
                    f"distlocks.backends.capabilities.{capability.__name__} to its bases "
                    f"(class {cls.__name__}({capability.__name__}, ...))."
                )
        _refuse_hidden_methods(cls)

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        self.alias = alias
        self.config = config
        self.options: Mapping[str, Any] = config.get("OPTIONS") or {}

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        """Return problems with ``config`` (no I/O); an empty list means it is usable."""
        problems = []
        unknown = set(config) - cls.config_keys - {"BACKEND"}
        if unknown:
            problems.append(
                f"unknown key(s) {', '.join(sorted(unknown))}; "
                f"{cls.__name__} accepts {', '.join(sorted(cls.config_keys | {'BACKEND'}))}"
            )
        options = config.get("OPTIONS", {})
        if not isinstance(options, Mapping):
            problems.append(f"OPTIONS must be a dict, not {type(options).__name__}")
        elif cls.option_keys is not None:
            problems.extend(unknown_options(cls.__name__, options, cls.option_keys))
        return problems

    #: True when the server frees a lock whose lease ran out (False: held until
    #: released or until the holder's connection ends).
    expires_on_server: ClassVar[bool] = True

    @classmethod
    def check_config(cls, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        """System-check messages for ``config`` (no I/O); by default one
        ``distlocks.E004`` per :meth:`validate_config` problem."""
        return [
            Error(
                "A DISTLOCKS_BACKENDS entry is not valid for its backend class.",
                hint=f"DISTLOCKS_BACKENDS[{alias!r}]: {problem}.",
                id="distlocks.E004",
            )
            for problem in cls.validate_config(alias, config)
        ]

    @abstractmethod
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
        """Take ``name`` for ``owner`` only if it is free, in one atomic step, minting a
        fencing token greater than every token issued for ``name`` before.

        Acquiring again with the same ``owner`` returns the same token (retry-safe).
        ``wait`` > 0 says the caller will wait up to that long if the lock is busy
        (so a release should wake it); with ``fair`` the lock goes to waiters in
        arrival order."""

    @abstractmethod
    def release(self, name: str, owner: str) -> bool:
        """Free ``name`` only if ``owner`` still holds it; True if this call freed it."""

    @abstractmethod
    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Reset the lease of ``owner`` on ``name`` to ``ttl`` seconds; False if not held."""

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | LockError]:
        """:meth:`extend` for several ``(name, owner, ttl)`` leases: one result each, in
        order (True, False, or the error met). The renewer calls it with every lease due
        at once; a backend overrides it to renew them in one round trip."""
        results: list[bool | LockError] = []
        for name, owner, ttl in leases:
            try:
                results.append(self.extend(name, owner, ttl))
            except LockError as exc:
                results.append(exc)
        return results

    def keep(self, name: str, owner: str, ttl: float) -> bool:
        """Keep ``owner``'s lock ``ttl`` seconds more although its holder is done with it
        (``lock_at_least_for``, :meth:`Lease.release_after`); False if not held. A backend
        that can also mark it as kept (so the live-locks page shows a kept lease, not a
        holder that stopped renewing) overrides this; the default just extends it."""
        return self.extend(name, owner, ttl)

    def local_lease(self, ttl: float) -> float:
        """How long after a successful acquire or extend with ``ttl`` the holder may trust
        its lease without hearing from the server: ``ttl``, unless the server can free
        the lock sooner (a ZooKeeper session shorter than ``ttl``)."""
        return ttl

    def lease_ended(self, name: str, owner: str) -> bool:
        """Whether ``owner``'s lease on ``name`` is known to have ended by itself, with
        no I/O: a transaction-level lock ends with its transaction. A reentrant lock
        then takes a new lease instead of re-entering the ended one. The default:
        never (a lease ends by release, expiry or loss, which the lease itself sees)."""
        return False

    @abstractmethod
    def inspect(self, name: str) -> LockInfo | None:
        """Describe the current holder of ``name``, or None when it is free."""

    @abstractmethod
    def force_release(self, name: str, token: int | None = None) -> bool:
        """Evict the holder of ``name`` and advance its fencing counter, so its fenced
        writes are rejected, in one server-side step. With ``token``, only if the holder's
        fencing token is ``token``: a lock that changed hands is left alone. A free lock
        is left as it is (nothing is written). True if a holder was evicted."""

    @abstractmethod
    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none yet)."""

    # -- asyncio ---------------------------------------------------------------
    # Defaults run the blocking methods in worker threads of the backend's own: one
    # pool for calls that may wait for a lock, one for quick calls (renewals,
    # releases), so waiters can never starve the holder's renewal.

    def _executor(self, waiting: bool) -> concurrent.futures.ThreadPoolExecutor:
        attr = "_wait_executor" if waiting else "_quick_executor"
        executor = self.__dict__.get(attr)
        if executor is None:
            with _executor_lock:
                executor = self.__dict__.get(attr)
                if executor is None:
                    executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=64 if waiting else 8,
                        thread_name_prefix=f"distlocks-{self.alias}-{'wait' if waiting else 'io'}",
                    )
                    self.__dict__[attr] = executor
        return executor

    async def _in_thread(self, waiting: bool, func: Callable[..., T], *args: Any, **kw: Any) -> T:
        if not self.calls_block:
            return func(*args, **kw)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor(waiting), functools.partial(func, *args, **kw)
        )

    async def _take_in_thread(
        self,
        waiting: bool,
        give_back: Callable[[AcquireResult | None], None],
        func: Callable[..., AcquireResult],
        *args: Any,
        **kw: Any,
    ) -> AcquireResult:
        """:meth:`_in_thread` for a call that may take something on the server (a lock,
        a permit, a wait-queue registration). Cancelling the caller does not stop the
        worker thread: if it is already running, ``give_back`` is called with what it
        returned (None if it raised) once it has finished, in a worker thread, so that
        nothing stays held or registered for an owner nobody will renew or release.
        The cancellation itself propagates at once."""
        if not self.calls_block:
            return func(*args, **kw)
        future = self._executor(waiting).submit(func, *args, **kw)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # Not started yet: cancel() stops it and there is nothing to give back.
            if not future.cancel():
                future.add_done_callback(functools.partial(self._abandoned, give_back))
            raise

    def _abandoned(
        self,
        give_back: Callable[[AcquireResult | None], None],
        future: concurrent.futures.Future[AcquireResult],
    ) -> None:
        """Done-callback of a cancelled :meth:`_take_in_thread` call: runs
        ``give_back`` quietly. It usually runs in the worker thread that just finished;
        when the call had finished already, it runs in the event loop's thread, so the
        (blocking) give-back goes to the quick pool instead."""
        if future.cancelled():
            return
        result = None if future.exception() is not None else future.result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a worker thread: no loop to block here
            self._give_back_quietly(give_back, result)
            return
        try:
            self._executor(False).submit(self._give_back_quietly, give_back, result)
        except RuntimeError:  # the pool is shut down (backend closed, interpreter exiting)
            logger.warning("Could not give back what a cancelled acquisition took on "
                           "backend %r; it lapses with its ttl", self.alias)  # fmt: skip

    def _give_back_quietly(
        self, give_back: Callable[[AcquireResult | None], None], result: AcquireResult | None
    ) -> None:
        try:
            give_back(result)
        except Exception as exc:
            log_expected(logger, exc, "Could not give back what a cancelled acquisition took "
                         "on backend %r; it lapses with its ttl", self.alias)  # fmt: skip

    def _give_back_lock(
        self, name: str, owner: str, wait: float, result: AcquireResult | None
    ) -> None:
        """Undo a cancelled :meth:`aacquire` whose thread went on: release the lock it
        took (a backend with ``Waiting`` then also leaves the wait queue it joined)."""
        if result is not None and result.acquired:
            logger.debug("Releasing lock %r of owner %r on backend %r: its acquirer "
                         "was cancelled", name, owner, self.alias)  # fmt: skip
            self.release_quietly(name, owner)

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
        """Async :meth:`acquire`. If the caller is cancelled while a worker thread is
        acquiring, what the thread takes is given back when it finishes."""
        give_back = functools.partial(self._give_back_lock, name, owner, wait)
        return await self._take_in_thread(
            wait > 0, give_back, self.acquire, name, owner, ttl, holder, wait=wait, fair=fair
        )

    async def arelease(self, name: str, owner: str) -> bool:
        """Async :meth:`release`."""
        return await self._in_thread(False, self.release, name, owner)

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        """Async :meth:`extend`."""
        return await self._in_thread(False, self.extend, name, owner, ttl)

    def release_quietly(self, name: str, owner: str) -> bool:
        """:meth:`release` for clean-up paths: a failure is logged, never raised."""
        try:
            return self.release(name, owner)
        except Exception as exc:
            log_expected(logger, exc, "Could not release lock %r on backend %r", name, self.alias)
            return False

    async def arelease_quietly(self, name: str, owner: str) -> bool:
        """Async :meth:`release_quietly`."""
        try:
            return await self.arelease(name, owner)
        except Exception as exc:
            log_expected(logger, exc, "Could not release lock %r on backend %r", name, self.alias)
            return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (connection pools); the backend is not used again."""

    def force_release_holder(self, info: LockInfo) -> bool:
        """Evict the holder ``info`` describes (an item of a listing, or of
        :meth:`inspect`): a plain lock by name and token. True if it was still held.
        :class:`~distlocks.backends.capabilities.Permits` adds a permit by its owner."""
        return self.force_release(info.name, info.fencing_token)
