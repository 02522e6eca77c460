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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
    permit_family,
)
from distlocks.backends.capabilities import Listing, Permits, Waiting


@dataclass
class _Entry:
    owner: str
    token: int
    ttl: float
    valid_until: float
    holder: Holder
    acquired_at: dt.datetime
    renewals: int = 0


@dataclass
class _Permit:
    kind: str
    token: int
    ttl: float
    valid_until: float
    holder: Holder
    acquired_at: dt.datetime
    limit: int
    renewals: int = 0


def _rw_counter(name: str) -> str:
    # Lock names have no control characters, so this never names a plain lock.
    return "\x00rwlock\x00" + name


class _Store:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.locks: dict[str, _Entry] = {}
        self.counters: dict[str, int] = {}
        # Fair waiters per lock name, in arrival order.
        self.queues: dict[str, list[str]] = {}
        # Semaphore permits and read-write leases per (family, name), by owner.
        self.permits: dict[tuple[str, str], dict[str, _Permit]] = {}
        # Callers waiting for a permit: (family, name) -> owner -> (kind, until).
        self.waiting: dict[tuple[str, str], dict[str, tuple[str, float]]] = {}

    def live_permits(self, key: tuple[str, str]) -> dict[str, _Permit]:
        """The unexpired permits of ``key`` (under ``cond``), expired ones dropped."""
        held = self.permits.get(key)
        if held is None:
            return {}
        now = time.monotonic()
        for owner in [o for o, p in held.items() if p.valid_until <= now]:
            del held[owner]
        if not held:
            del self.permits[key]
        return held

    def live_waiting(self, key: tuple[str, str]) -> dict[str, tuple[str, float]]:
        waiting = self.waiting.get(key)
        if waiting is None:
            return {}
        now = time.monotonic()
        for owner in [o for o, (_, until) in waiting.items() if until <= now]:
            del waiting[owner]
        if not waiting:
            del self.waiting[key]
        return waiting

    def room(self, kind: str, name: str, owner: str, limit: int) -> tuple[bool, float | None]:
        """Whether ``owner`` may take a permit of ``kind`` now and, if not, when the
        permit in its way ends at the latest (None: unknown). Under ``cond``."""
        held = self.live_permits((permit_family(kind), name))
        others = [p for o, p in held.items() if o != owner]
        now = time.monotonic()
        if kind == SEMAPHORE:
            blockers = others if len(others) >= limit else []
        elif kind == READ:
            blockers = [p for p in others if p.kind == WRITE]
            if not blockers:
                waiting = self.live_waiting((RWLOCK, name))
                if any(k == WRITE for o, (k, _) in waiting.items() if o != owner):
                    return False, None  # a waiting writer goes first
        else:
            blockers = others
        if not blockers:
            return True, None
        return False, max(0.0, min(p.valid_until for p in blockers) - now)

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

    def sleep(
        self, timeout: float, ready: Callable[[], bool], due: Callable[[], float | None]
    ) -> None:
        """Wait on ``cond`` (held) until ``ready()``, a notification that makes it so,
        or ``timeout`` seconds. Each wait is cut at ``due()``, the monotonic time when
        what is in the way ends by itself (a lease's expiry, a registration lapsing):
        nobody notifies then, and what was in the way may have changed while this
        caller slept (the waiter ahead took the lock: its lease now ends first)."""
        deadline = time.monotonic() + timeout
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                return
            until = due()
            # A moment past the expiry, so that live() sees it ended.
            seconds = deadline - now if until is None else min(deadline, until + 0.001) - now
            self.cond.wait(max(seconds, 0.0))

    def lock_due(self, name: str) -> float | None:
        """When the lease of ``name``'s holder ends (None: not held). Under ``cond``."""
        entry = self.live(name)
        return None if entry is None else entry.valid_until

    def permit_due(self, kind: str, name: str, owner: str, limit: int) -> float | None:
        """When the first thing keeping ``owner`` from a permit ends by itself: a permit
        in its way, or the registration of a writer it lets go first. Under ``cond``."""
        key = (permit_family(kind), name)
        ends = [p.valid_until for o, p in self.live_permits(key).items() if o != owner]
        if kind == READ:
            ends += [
                u
                for o, (k, u) in self.live_waiting((RWLOCK, name)).items()
                if o != owner and k == WRITE
            ]
        return min(ends, default=None)

    def live(self, name: str) -> _Entry | None:
        entry = self.locks.get(name)
        if entry is not None and time.monotonic() >= entry.valid_until:
            del self.locks[name]
            return None
        return entry


_stores: dict[str, _Store] = {}
_stores_lock = threading.Lock()


class LocMemBackend(Listing, Waiting, Permits, BaseBackend):
    """Locks in this process's memory, shared by backends with the same ``LOCATION``."""

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION"})
    #: LocMem reads no option: any key is a mistake.
    option_keys: ClassVar[frozenset[str] | None] = frozenset()

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
                else:
                    # Those still queued may be asleep with no expiry to wait for (it
                    # was not their turn): this lease's end is one now.
                    store.cond.notify_all()
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

    def keep(self, name: str, owner: str, ttl: float) -> bool:
        with self._store.cond:
            entry = self._store.live(name)
            if entry is None or entry.owner != owner:
                return False
            entry.valid_until = time.monotonic() + ttl
            entry.ttl = ttl
            holder = entry.holder
            # The listing reads it as the JSON value true, as from Redis.
            extra: dict[str, Any] = {**holder.extra, "kept": True}
            entry.holder = type(holder)(holder.host, holder.pid, holder.thread, extra)
            return True

    def force_release(self, name: str, token: int | None = None) -> bool:
        store = self._store
        with store.cond:
            entry = store.live(name)
            if entry is None or (token is not None and entry.token != token):
                return False
            # Advance the counter so the evicted holder's token is outdated at once.
            store.next_token(name)
            del store.locks[name]
            store.cond.notify_all()
            return True

    def fencing_counter(self, name: str) -> int:
        with self._store.cond:
            return self._store.counters.get(name, 0)

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        store = self._store
        with store.cond:
            store.sleep(
                timeout, lambda: store.may_take(name, owner, fair), lambda: store.lock_due(name)
            )

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
        yield from self.iter_permits()

    # -- semaphores and read-write locks ------------------------------------------

    permit_kinds = frozenset({SEMAPHORE, READ, WRITE})

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
        self.check_permit_kind(kind)
        store = self._store
        key = (permit_family(kind), name)
        with store.cond:
            now = time.monotonic()
            mine = store.live_permits(key).get(owner)
            if mine is not None:  # a retried request: it is ours
                mine.valid_until = now + ttl
                return AcquireResult(True, mine.token, ttl)
            room, remaining = store.room(kind, name, owner, limit)
            if not room:
                if wait > 0:
                    # Registered for as long as it may wait; a waiting writer holds up
                    # new readers meanwhile.
                    store.waiting.setdefault(key, {})[owner] = (kind, now + wait + 1.0)
                return AcquireResult(False, 0, remaining)
            if store.live_waiting(key).pop(owner, None) is not None:
                # Callers it held up may be asleep with no expiry to wait for: this
                # permit's end is one now.
                store.cond.notify_all()
            token = store.next_token(_rw_counter(name)) if kind == WRITE else 0
            store.permits.setdefault(key, {})[owner] = _Permit(
                kind=kind,
                token=token,
                ttl=ttl,
                valid_until=now + ttl,
                holder=holder,
                acquired_at=dt.datetime.now(dt.UTC),
                limit=limit,
            )
            return AcquireResult(True, token, ttl)

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        self.check_permit_kind(kind)
        store = self._store
        key = (permit_family(kind), name)
        with store.cond:
            held = store.live_permits(key)
            permit = held.get(owner)
            if permit is None or permit.kind != kind:
                return False
            del held[owner]
            if not held:
                del store.permits[key]
            store.cond.notify_all()
            return True

    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        self.check_permit_kind(kind)
        store = self._store
        with store.cond:
            permit = store.live_permits((permit_family(kind), name)).get(owner)
            if permit is None or permit.kind != kind:
                return False
            permit.valid_until = time.monotonic() + ttl
            permit.ttl = ttl
            permit.renewals += 1
            return True

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        store = self._store
        with store.cond:
            store.sleep(
                timeout,
                lambda: store.room(kind, name, owner, limit)[0],
                lambda: store.permit_due(kind, name, owner, limit),
            )

    async def apermit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        # Poll with a short, growing interval: the loop stays free, no thread is used.
        deadline = time.monotonic() + timeout
        interval = 0.001
        store = self._store
        while time.monotonic() < deadline:
            with store.cond:
                if store.room(kind, name, owner, limit)[0]:
                    return
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 2, 0.02)

    def permit_leave(self, kind: str, name: str, owner: str) -> None:
        store = self._store
        with store.cond:
            if store.live_waiting((permit_family(kind), name)).pop(owner, None) is not None:
                # Readers it held up may go in now.
                store.cond.notify_all()

    def _permit_info(self, name: str, owner: str, permit: _Permit, waiters: int) -> LockInfo:
        remaining = max(0.0, permit.valid_until - time.monotonic())
        extra: dict[str, object] = {**permit.holder.extra, "kind": permit.kind}
        if permit.kind == SEMAPHORE:
            extra["limit"] = permit.limit
        return LockInfo(
            name=name,
            backend=self.alias,
            owner=owner,
            fencing_token=permit.token,
            host=permit.holder.host,
            pid=permit.holder.pid,
            thread=permit.holder.thread,
            acquired_at=permit.acquired_at,
            expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=remaining),
            ttl=permit.ttl,
            renewals=permit.renewals,
            waiters=waiters,
            extra=extra,
        )

    def _permit_infos(self, key: tuple[str, str]) -> list[LockInfo]:
        """Under ``cond``."""
        held = self._store.live_permits(key)
        waiters = len(self._store.live_waiting(key))
        return [self._permit_info(key[1], o, p, waiters) for o, p in list(held.items())]

    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        self.check_permit_kind(kind)
        with self._store.cond:
            return self._permit_infos((permit_family(kind), name))

    def iter_permits(self) -> Iterator[LockInfo]:
        with self._store.cond:
            infos = [info for key in list(self._store.permits) for info in self._permit_infos(key)]
        yield from infos

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        self.check_permit_kind(kind)
        store = self._store
        key = (permit_family(kind), name)
        with store.cond:
            held = store.live_permits(key)
            evicted = [o for o in held if owner is None or o == owner]
            for o in evicted:
                del held[o]
            if not held:
                store.permits.pop(key, None)
            if key[0] == RWLOCK:
                # Outdate the tokens of any writer evicted.
                store.next_token(_rw_counter(name))
            store.cond.notify_all()
            return len(evicted)

    def permit_counter(self, name: str) -> int:
        self.check_permit_kind(WRITE)
        with self._store.cond:
            return self._store.counters.get(_rw_counter(name), 0)

    def clear(self) -> None:
        """Drop every lock; fencing counters are kept, so tokens never go backwards."""
        with self._store.cond:
            self._store.locks.clear()
            self._store.permits.clear()
            self._store.waiting.clear()
            self._store.cond.notify_all()
