"""In-process backend: locks visible only inside one Python process.

For tests and development. It gives the full contract (expiry, fencing,
ownership checks, wake-ups on release) but no other process sees its locks,
so it must never guard anything shared between processes; the ``distlocks.W001``
check warns when it is configured with ``DEBUG = False``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distlocks.backends.base import AcquireResult, BaseBackend, Holder, LockInfo


@dataclass
class _Entry:
    owner: str
    token: int
    ttl: float
    valid_until: float
    holder: Holder
    acquired_at: dt.datetime
    renewals: int = 0


class _Store:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.locks: dict[str, _Entry] = {}
        self.counters: dict[str, int] = {}
        # Fair waiters per lock name, in arrival order.
        self.queues: dict[str, list[str]] = {}

    def next_token(self, name: str) -> int:
        """One more than the last token, floored by the clock in microseconds, so a
        new process never issues tokens below those of an earlier one."""
        token = max(self.counters.get(name, 0) + 1, time.time_ns() // 1000)
        self.counters[name] = token
        return token

    def may_take(self, name: str, owner: str, fair: bool) -> bool:
        """``name`` is free and, for a fair waiter, it is its turn (under ``cond``)."""
        queue = self.queues.get(name)
        return self.live(name) is None and (not fair or not queue or queue[0] == owner)

    def live(self, name: str) -> _Entry | None:
        entry = self.locks.get(name)
        if entry is not None and time.monotonic() >= entry.valid_until:
            del self.locks[name]
            return None
        return entry


_stores: dict[str, _Store] = {}
_stores_lock = threading.Lock()


class LocMemBackend(BaseBackend):
    """Locks in this process's memory, shared by backends with the same ``LOCATION``."""

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION"})

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        location = config.get("LOCATION", "")
        with _stores_lock:
            self._store = _stores.setdefault(location, _Store())

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        if not isinstance(config.get("LOCATION", ""), str):
            problems.append("LOCATION must be a str naming the in-memory store")
        return problems

    wakes_on_release = True
    calls_block = False  # a few dict updates under a lock: async calls run inline

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
        store = self._store
        with store.cond:
            entry = store.live(name)
            now = time.monotonic()
            if entry is not None:
                if entry.owner == owner:
                    entry.valid_until = now + ttl
                    return AcquireResult(True, entry.token, ttl)
                if fair and wait > 0:
                    queue = store.queues.setdefault(name, [])
                    if owner not in queue:
                        queue.append(owner)
                return AcquireResult(False, 0, entry.valid_until - now)
            waiting = store.queues.get(name)
            if fair and waiting and waiting[0] != owner:
                if wait > 0 and owner not in waiting:
                    waiting.append(owner)
                return AcquireResult(False, 0, None)
            if waiting and owner in waiting:
                waiting.remove(owner)
                if not waiting:
                    del store.queues[name]
            token = store.next_token(name)
            store.locks[name] = _Entry(
                owner=owner,
                token=token,
                ttl=ttl,
                valid_until=now + ttl,
                holder=holder,
                acquired_at=dt.datetime.now(dt.UTC),
            )
            return AcquireResult(True, token, ttl)

    def leave_queue(self, name: str, owner: str) -> None:
        store = self._store
        with store.cond:
            queue = store.queues.get(name)
            if queue and owner in queue:
                queue.remove(owner)
                if not queue:
                    del store.queues[name]
                store.cond.notify_all()

    def release(self, name: str, owner: str) -> bool:
        store = self._store
        with store.cond:
            entry = store.live(name)
            if entry is None or entry.owner != owner:
                return False
            del store.locks[name]
            store.cond.notify_all()
            return True

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        with self._store.cond:
            entry = self._store.live(name)
            if entry is None or entry.owner != owner:
                return False
            entry.valid_until = time.monotonic() + ttl
            entry.ttl = ttl
            entry.renewals += 1
            return True

    def force_release(self, name: str) -> bool:
        store = self._store
        with store.cond:
            entry = store.live(name)
            # Advance the counter so the evicted holder's token is outdated at once.
            store.next_token(name)
            if entry is None:
                return False
            del store.locks[name]
            store.cond.notify_all()
            return True

    def fencing_counter(self, name: str) -> int:
        with self._store.cond:
            return self._store.counters.get(name, 0)

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        store = self._store
        with store.cond:
            if not store.may_take(name, owner, fair):
                store.cond.wait(timeout)

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        # Poll with a short, growing interval: the loop stays free, no thread is used.
        deadline = time.monotonic() + timeout
        interval = 0.001
        store = self._store
        while time.monotonic() < deadline:
            with store.cond:
                if store.may_take(name, owner, fair):
                    return
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 2, 0.02)

    def _info(self, name: str, entry: _Entry) -> LockInfo:
        remaining = max(0.0, entry.valid_until - time.monotonic())
        return LockInfo(
            name=name,
            backend=self.alias,
            owner=entry.owner,
            fencing_token=entry.token,
            host=entry.holder.host,
            pid=entry.holder.pid,
            thread=entry.holder.thread,
            acquired_at=entry.acquired_at,
            expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=remaining),
            ttl=entry.ttl,
            renewals=entry.renewals,
            waiters=len(self._store.queues.get(name, ())),
            extra=dict(entry.holder.extra),
        )

    def inspect(self, name: str) -> LockInfo | None:
        with self._store.cond:
            entry = self._store.live(name)
            return None if entry is None else self._info(name, entry)

    def iter_locks(self) -> Iterator[LockInfo]:
        with self._store.cond:
            names = list(self._store.locks)
            infos = [
                self._info(name, entry)
                for name in names
                if (entry := self._store.live(name)) is not None
            ]
        yield from infos

    def clear(self) -> None:
        """Drop every lock; fencing counters are kept, so tokens never go backwards."""
        with self._store.cond:
            self._store.locks.clear()
            self._store.cond.notify_all()
