"""Live locks across every configured backend, for the admin page, the command and metrics.

Whatever a backend's :meth:`~distlocks.backends.base.BaseBackend.iter_locks` yields
is listed, so a new backend shows up without changes here. Each lock gets a status:

``orphaned``
    Its holder is gone: the holding process runs on this host and no longer exists;
    or (PostgreSQL) the holding session has vanished or sat idle, without the renewal
    pings a session-mode lease sends at a third of its ttl, for longer than the ttl;
    or (a backend with expiry) it had been renewed and has now missed renewals
    (less than a third of its ttl is left).
``stuck``
    Held for longer than ``DISTLOCKS_STUCK_AFTER`` seconds.
``expiring``
    Less than a third of its ttl left: an auto-renewed lease is always extended
    before that, so it is about to run out.
``ok``
    None of the above.

A backend that cannot be reached, or fails in any way, is reported as an error of its
own and never hides the locks of the others.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distlocks import signals
from distlocks.backends.base import BaseBackend, LockInfo
from distlocks.conf import conf
from distlocks.handler import backend_configs, backends

logger = logging.getLogger(__name__)

OK = "ok"
EXPIRING = "expiring"
STUCK = "stuck"
ORPHANED = "orphaned"
#: Most severe first: the order of the status sort.
STATUSES = (ORPHANED, STUCK, EXPIRING, OK)
#: Less than this fraction of the ttl left: an auto-renewed lease would have been extended.
EXPIRING_FRACTION = 1 / 3
#: Upper bound of locks read per backend for one listing; beyond it the listing is
#: marked truncated rather than exhausting memory or time.
DEFAULT_LIMIT = 100_000

_HOSTNAME = socket.gethostname()


def _pid_gone(pid: int) -> bool:
    """True only when ``pid`` certainly does not run on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by another user
        return False
    return False


@dataclass(frozen=True)
class LiveLock:
    """One live lock with its status, as the page and the command show it."""

    info: LockInfo
    status: str
    #: Why the status is not ``ok`` (empty when it is).
    reason: str = ""
    #: Other aliases that show this same lock (they point at the same server).
    also: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def backend(self) -> str:
        return self.info.backend

    @property
    def celery_task_id(self) -> str:
        return str(self.info.extra.get("celery_task_id") or "")

    @property
    def backend_pid(self) -> int | None:
        value = self.info.extra.get("backend_pid")
        return int(value) if isinstance(value, int) else None

    @property
    def held_for(self) -> float | None:
        held = self.info.held_for
        return None if held is None else max(0.0, held.total_seconds())

    @property
    def expires_in(self) -> float | None:
        left = self.info.expires_in
        return None if left is None else max(0.0, left.total_seconds())

    @property
    def holder(self) -> str:
        """``host pid/thread`` in one short string."""
        info = self.info
        parts = [info.host or "?"]
        if info.pid is not None:
            parts.append(f"pid {info.pid}")
        if info.thread:
            parts.append(info.thread)
        return " ".join(parts)

    @property
    def extra_items(self) -> list[tuple[str, str]]:
        """The holder's and the backend's extra details, for display."""
        return [(str(k), "" if v is None else str(v)) for k, v in sorted(self.info.extra.items())]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly description (for ``manage.py distlocks list --json``)."""
        info = self.info
        return {
            "name": info.name,
            "backend": info.backend,
            "also": list(self.also),
            "status": self.status,
            "reason": self.reason,
            "owner": info.owner,
            "host": info.host,
            "pid": info.pid,
            "thread": info.thread,
            "celery_task_id": self.celery_task_id or None,
            "backend_pid": self.backend_pid,
            "acquired_at": info.acquired_at.isoformat() if info.acquired_at else None,
            "expires_at": info.expires_at.isoformat() if info.expires_at else None,
            "held_for": _round(self.held_for),
            "expires_in": _round(self.expires_in),
            "ttl": info.ttl,
            "fencing_token": info.fencing_token,
            "renewals": info.renewals,
            "waiters": info.waiters,
            "extra": {k: _jsonable(v) for k, v in info.extra.items()},
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


def classify(
    info: LockInfo,
    *,
    now: dt.datetime | None = None,
    stuck_after: float | None = None,
    pid_gone: Callable[[int], bool] | None = None,
) -> tuple[str, str]:
    """``(status, reason)`` of one lock; see the module docstring for the rules."""
    now = now or dt.datetime.now(dt.UTC)
    stuck_after = conf.STUCK_AFTER if stuck_after is None else stuck_after
    orphan = _orphan_reason(info, now, pid_gone or _pid_gone)
    if orphan:
        return ORPHANED, orphan
    if info.acquired_at is not None:
        held = (now - info.acquired_at).total_seconds()
        if held > stuck_after:
            return STUCK, (
                f"held for {format_seconds(held)}, longer than DISTLOCKS_STUCK_AFTER "
                f"({format_seconds(stuck_after)})"
            )
    if info.expires_at is not None and info.ttl:
        left = (info.expires_at - now).total_seconds()
        if left < info.ttl * EXPIRING_FRACTION:
            return EXPIRING, f"{format_seconds(max(0.0, left))} left of a {info.ttl:g}s lease"
    return OK, ""


def _orphan_reason(info: LockInfo, now: dt.datetime, pid_gone: Callable[[int], bool]) -> str:
    if info.host == _HOSTNAME and info.pid is not None and pid_gone(info.pid):
        return f"its holder process {info.pid} on {info.host} no longer exists"
    extra = info.extra
    if "backend_pid" in extra:
        # PostgreSQL: the holder's server session. Present in pg_locks but missing
        # from pg_stat_activity means the session is going away.
        if extra.get("session_state") is None and extra.get("application_name") is None:
            return f"its PostgreSQL session (backend pid {extra['backend_pid']}) is gone"
        last = extra.get("last_activity")
        if extra.get("session_state") == "idle" and isinstance(last, dt.datetime) and info.ttl:
            if last.tzinfo is None:
                last = last.replace(tzinfo=dt.UTC)
            quiet = (now - last).total_seconds()
            if quiet > info.ttl:
                return (
                    f"its PostgreSQL session (backend pid {extra['backend_pid']}) has been "
                    f"idle for {format_seconds(quiet)}, longer than the {info.ttl:g}s lease: "
                    f"the holder stopped renewing"
                )
    if info.renewals > 0 and info.expires_at is not None and info.ttl:
        left = (info.expires_at - now).total_seconds()
        if left < info.ttl * EXPIRING_FRACTION:
            return (
                f"renewed {info.renewals} time(s), then stopped: "
                f"{format_seconds(max(0.0, left))} left of a {info.ttl:g}s lease"
            )
    return ""


def format_seconds(seconds: float | None) -> str:
    """``1h 02m``, ``3m 05s``, ``4.2s``: short and sortable by eye."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"


@dataclass
class Snapshot:
    """The live locks of some backends at one moment, and what went wrong reading them."""

    #: When it was read (wall clock, for display).
    taken_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    locks: list[LiveLock] = field(default_factory=list)
    #: alias -> message, for each backend that could not be read.
    errors: dict[str, str] = field(default_factory=dict)
    #: Aliases whose listing stopped at the limit.
    truncated: list[str] = field(default_factory=list)
    #: Every alias asked for, in settings order.
    aliases: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, dict[str, int]]:
        """alias -> status -> number of locks."""
        counts = {alias: dict.fromkeys(STATUSES, 0) for alias in self.aliases}
        for item in self.locks:
            counts.setdefault(item.backend, dict.fromkeys(STATUSES, 0))[item.status] += 1
        return counts


def configured_aliases() -> list[str]:
    """The aliases of ``DISTLOCKS_BACKENDS`` (empty if the setting is unusable)."""
    try:
        return list(backend_configs())
    except Exception:  # reported by the system checks; the page shows no backend
        logger.warning("DISTLOCKS_BACKENDS is not usable", exc_info=True)
        return []


def get(alias: str) -> BaseBackend:
    """The backend ``alias``; ImproperlyConfigured for an unknown alias."""
    return backends[alias]


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def collect(
    aliases: Iterable[str] | None = None,
    *,
    limit: int = DEFAULT_LIMIT,
    now: dt.datetime | None = None,
) -> Snapshot:
    """Read the live locks of ``aliases`` (default: every configured backend).

    One pass per backend, in turn; a failing backend is recorded and skipped. Aliases
    that point at the same server see the same locks: each lock is listed once, under
    the first of them in settings order, with the others in :attr:`LiveLock.also`.
    """
    snapshot = Snapshot(aliases=list(configured_aliases() if aliases is None else aliases))
    now = now or dt.datetime.now(dt.UTC)
    stuck_after = conf.STUCK_AFTER
    gone: dict[int, bool] = {}

    def pid_gone(pid: int) -> bool:  # one system call per holder process, not per lock
        if pid not in gone:
            gone[pid] = _pid_gone(pid)
        return gone[pid]

    read: dict[Any, str] = {}  # where -> the alias it was read through
    for alias in snapshot.aliases:
        where = _source(alias)
        if where is not None and where in read:
            # The same server and key prefix as an alias already read: same locks.
            first = read[where]
            if first in snapshot.errors:
                snapshot.errors[alias] = snapshot.errors[first]
            continue
        found: list[LiveLock] = []
        try:
            for info in get(alias).iter_locks():
                if len(found) >= limit:
                    snapshot.truncated.append(alias)
                    break
                status = classify(info, now=now, stuck_after=stuck_after, pid_gone=pid_gone)
                found.append(LiveLock(info, *status))
        except Exception as exc:
            # The page and the command must still answer: report this backend, go on.
            logger.warning("Could not list the locks of backend %r", alias, exc_info=True)
            snapshot.errors[alias] = describe_error(exc)
        if where is not None:
            read[where] = alias
        snapshot.locks.extend(found)
    snapshot.locks = _merge_aliases(snapshot.locks)
    also: dict[str, tuple[str, ...]] = {}
    for where, first in read.items():
        also[first] = tuple(a for a in snapshot.aliases if a != first and _source(a) == where)
    if any(also.values()):
        snapshot.locks = [
            dataclasses.replace(item, also=(*item.also, *also.get(item.backend, ())))
            if also.get(item.backend)
            else item
            for item in snapshot.locks
        ]
    return snapshot


class SnapshotCache:
    """The last snapshot of each set of aliases, reused for ``ttl`` seconds.

    Paging, sorting, searching and filtering a listing then cost one page of work, not
    a new pass over every lock. A force release empties it; the page of one lock
    always reads the server.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Any, tuple[float, Snapshot]] = {}

    def get(self, aliases: Sequence[str], ttl: float, limit: int = DEFAULT_LIMIT) -> Snapshot:
        key = (tuple(aliases), limit, conf.STUCK_AFTER)
        now = time.monotonic()
        with self._lock:
            found = self._entries.get(key)
        if found is not None and now - found[0] < ttl:
            return found[1]
        snapshot = collect(aliases, limit=limit)
        with self._lock:
            if len(self._entries) > 32:
                self._entries.clear()
            self._entries[key] = (time.monotonic(), snapshot)
        return snapshot

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


snapshots = SnapshotCache()


def _source(alias: str) -> Any:
    """What identifies the locks an alias sees: its class, server and key prefix (two
    aliases that differ only in other options list the same locks). None if unknown."""
    try:
        config = backend_configs()[alias]
        prefix = getattr(get(alias), "key_prefix", None)
    except Exception:
        return None
    server = tuple(repr(config.get(key)) for key in ("LOCATION", "CACHE", "DATABASE"))
    return (repr(config.get("BACKEND")), server, prefix)


def _merge_aliases(items: list[LiveLock]) -> list[LiveLock]:
    # The owner is a random id per acquisition: the same (name, owner) read through
    # two aliases is one lock.
    first: dict[tuple[str, str], int] = {}
    merged: list[LiveLock] = []
    for item in items:
        key = (item.name, item.info.owner)
        index = first.get(key)
        if index is None:
            first[key] = len(merged)
            merged.append(item)
        elif item.backend != merged[index].backend and item.backend not in merged[index].also:
            kept = merged[index]
            merged[index] = dataclasses.replace(kept, also=(*kept.also, item.backend))
    return merged


def inspect(alias: str, name: str) -> LiveLock | None:
    """The live lock ``name`` on ``alias`` (None when free); errors propagate."""
    info = get(alias).inspect(name)
    return None if info is None else LiveLock(info, *classify(info))


def complete(items: Sequence[LiveLock]) -> list[LiveLock]:
    """Fill in what a backend's listing leaves out (e.g. waiters on Redis) for a few
    rows, one ``inspect()`` each: for one page of a listing, never the whole of it."""
    done = []
    for item in items:
        if item.info.waiters is not None:
            done.append(item)
            continue
        try:
            fresh = inspect(item.backend, item.name)
        except Exception:
            logger.debug("Could not inspect %r on %r", item.name, item.backend, exc_info=True)
            fresh = None
        # A lock freed meanwhile keeps its listed details.
        if fresh is not None and fresh.info.owner == item.info.owner:
            item = dataclasses.replace(fresh, also=item.also)
        done.append(item)
    return done


@dataclass(frozen=True)
class ForceReleased:
    """What :func:`force_release` did."""

    alias: str
    name: str
    #: The holder just before (None: the lock was already free).
    before: LiveLock | None
    #: True when the call freed a held lock.
    released: bool
    #: The lock's fencing counter afterwards: every token up to it is now stale.
    counter: int | None


class TokenChanged(Exception):
    """The lock changed hands since the operator looked at it."""

    def __init__(self, current: LiveLock | None) -> None:
        self.current = current
        super().__init__("the lock changed hands since it was shown")


def force_release(
    alias: str,
    name: str,
    *,
    expected_token: int | None = None,
    user: Any = None,
    via: str = "admin",
) -> ForceReleased:
    """Free ``name`` on ``alias`` whoever holds it, advancing its fencing counter.

    With ``expected_token``, refuse (:class:`TokenChanged`) when the lock is no longer
    held under that token: the operator confirmed the eviction of one holder, not of
    whoever took the lock since. Sends ``lock_force_released``.
    """
    backend = get(alias)
    before = inspect(alias, name)
    current_token = None if before is None else before.info.fencing_token
    if expected_token is not None and current_token != expected_token:
        raise TokenChanged(before)
    released = backend.force_release(name)
    if released and before is not None:
        _wait_evicted(backend, name, before.info.owner)
    snapshots.clear()
    try:
        counter: int | None = backend.fencing_counter(name)
    except Exception:
        logger.warning("Could not read the fencing counter of %r on %r", name, alias, exc_info=True)
        counter = None
    logger.warning(
        "Lock %r on backend %r force-released via %s by %s (holder before: %s, token %s)",
        name, alias, via, user or "-", before.holder if before else "none",
        before.info.fencing_token if before else "-",
    )  # fmt: skip
    signals.lock_force_released.send_robust(
        sender=type(backend),
        name=name,
        backend=alias,
        info=before.info if before else None,
        released=released,
        user=user,
        via=via,
    )
    return ForceReleased(alias, name, before, released, counter)


#: Longest wait for an evicted holder to disappear from the server's view.
EVICTION_WAIT = 5.0


def _wait_evicted(backend: BaseBackend, name: str, owner: str) -> None:
    """Return once the server no longer shows ``owner`` holding ``name``.

    A backend may evict asynchronously (PostgreSQL signals the holder's session to
    end, and its locks go when it has exited): the page shown next, and the caller,
    must not still see the evicted holder.
    """
    deadline = time.monotonic() + EVICTION_WAIT
    while True:
        try:
            info = backend.inspect(name)
        except Exception:
            return  # nothing to wait on that can be read
        if info is None or info.owner != owner:
            return
        if time.monotonic() >= deadline:
            logger.warning(
                "Lock %r on backend %r still shows its evicted holder after %ss",
                name, backend.alias, EVICTION_WAIT,
            )  # fmt: skip
            return
        time.sleep(0.01)


# -- listing: search, filters, sort, pages -----------------------------------------

#: Sort keys: query value -> (key function, reversed). Times sort by the stored
#: instant (held longest = acquired earliest), which needs no clock read per row.
SORTS: dict[str, tuple[Callable[[LiveLock], Any], bool]] = {
    "name": (lambda x: x.name, False),
    "backend": (lambda x: (x.backend, x.also), False),
    "holder": (lambda x: x.holder, False),
    "acquired": (lambda x: x.info.acquired_at, False),
    "held": (lambda x: x.info.acquired_at, True),
    "expires": (lambda x: x.info.expires_at, False),
    "token": (lambda x: x.info.fencing_token, False),
    "renewals": (lambda x: x.info.renewals, False),
    "waiters": (lambda x: x.info.waiters, False),
    "status": (lambda x: STATUSES.index(x.status), False),
}


def matches(item: LiveLock, query: str) -> bool:
    """Case-insensitive search in the name, the holder's host and its Celery task id."""
    query = query.casefold()
    return any(
        query in text.casefold() for text in (item.name, item.info.host, item.celery_task_id)
    )


def select(
    items: Iterable[LiveLock],
    *,
    query: str = "",
    status: str = "",
    backend: str = "",
    order: str = "name",
) -> list[LiveLock]:
    """Filter and sort; ``order`` is a :data:`SORTS` key, ``-`` in front for descending."""
    chosen = [
        item
        for item in items
        if (not status or item.status == status)
        and (not backend or item.backend == backend or backend in item.also)
        and (not query or matches(item, query))
    ]
    key, flip = SORTS.get(order.lstrip("-"), SORTS["name"])
    descending = order.startswith("-") != flip
    # Each key computed once; ties keep name order; rows without a value go last.
    chosen.sort(key=lambda x: (x.name, x.backend))
    keyed = [(key(item), item) for item in chosen]
    present = [pair for pair in keyed if pair[0] is not None]
    present.sort(key=lambda pair: pair[0], reverse=descending)
    return [item for _, item in present] + [item for k, item in keyed if k is None]


def status_counts(items: Iterable[LiveLock]) -> Mapping[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for item in items:
        counts[item.status] += 1
    return counts
