"""The contract every lock backend fulfils.

A backend is a thin, stateless-per-call adapter over one lock server. All the
lease bookkeeping (deadlines, loss detection, signals) lives in
:mod:`distlocks.lease`; a backend only has to make each operation below one
atomic step on its server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from django.core.checks import CheckMessage, Error

logger = logging.getLogger(__name__)
T = TypeVar("T")
_executor_lock = threading.Lock()


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


class BaseBackend(ABC):
    """Base class of lock backends.

    Subclasses are created by :mod:`distlocks.handler` from one entry of
    ``DISTLOCKS_BACKENDS``; ``config`` is that entry as written in settings.
    """

    #: False when every call returns at once (an in-process backend): the async
    #: methods then run inline instead of in a worker thread.
    calls_block: ClassVar[bool] = True
    #: Config keys this backend understands, besides ``BACKEND``.
    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS"})

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
        return problems

    #: True when :meth:`wait` returns as soon as the lock is released (no polling).
    wakes_on_release: ClassVar[bool] = False
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

    @abstractmethod
    def inspect(self, name: str) -> LockInfo | None:
        """Describe the current holder of ``name``, or None when it is free."""

    @abstractmethod
    def iter_locks(self) -> Iterator[LockInfo]:
        """Yield every live lock on this backend."""

    @abstractmethod
    def force_release(self, name: str) -> bool:
        """Free ``name`` whoever holds it, and advance its fencing counter so the
        evicted holder's fenced writes are rejected; True if it was held."""

    @abstractmethod
    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none yet)."""

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        """Block up to ``timeout`` seconds, or less when ``name`` may have been freed.

        The default sleeps; backends with ``wakes_on_release`` return at the release.
        """
        time.sleep(max(0.0, timeout))

    def leave_queue(self, name: str, owner: str) -> None:  # noqa: B027 - optional hook
        """``owner`` stopped waiting for ``name`` (timeout or error): forget it, so it
        does not hold up the waiters behind it."""

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
        """Async :meth:`acquire`."""
        return await self._in_thread(
            wait > 0, self.acquire, name, owner, ttl, holder, wait=wait, fair=fair
        )

    async def arelease(self, name: str, owner: str) -> bool:
        """Async :meth:`release`."""
        return await self._in_thread(False, self.release, name, owner)

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        """Async :meth:`extend`."""
        return await self._in_thread(False, self.extend, name, owner, ttl)

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        """Async :meth:`wait`."""
        await self._in_thread(True, self.wait, name, timeout, owner=owner, fair=fair)

    async def aleave_queue(self, name: str, owner: str) -> None:
        """Async :meth:`leave_queue`."""
        await self._in_thread(False, self.leave_queue, name, owner)

    def release_quietly(self, name: str, owner: str) -> bool:
        """:meth:`release` for clean-up paths: a failure is logged, never raised."""
        try:
            return self.release(name, owner)
        except Exception:
            logger.warning("Could not release lock %r on backend %r", name, self.alias,
                           exc_info=True)  # fmt: skip
            return False

    async def arelease_quietly(self, name: str, owner: str) -> bool:
        """Async :meth:`release_quietly`."""
        try:
            return await self.arelease(name, owner)
        except Exception:
            logger.warning("Could not release lock %r on backend %r", name, self.alias,
                           exc_info=True)  # fmt: skip
            return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (connection pools); the backend is not used again."""
