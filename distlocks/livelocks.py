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
``kept``
    Kept on purpose after its holder finished (``lock_at_least_for``,
    ``Lease.release_after()``): held until it runs out, which is expected, not an alarm.
    Checked before the others: its holder may well have exited since.
``ok``
    None of the above.

A backend that cannot be reached, or fails in any way, is reported as an error of its
own and never hides the locks of the others.

Besides plain locks, a listing has semaphore permits and read-write leases: several
holders may share one name, so a row is identified by its backend, kind, name and,
for a permit, its holder's owner id (see :class:`LiveLock`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import functools
import itertools
import logging
import operator
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from distlocks import signals
from distlocks.backends.base import (
    READ,
    SEMAPHORE,
    WRITE,
    BaseBackend,
    LockInfo,
    holder_details,
)
from distlocks.conf import conf
from distlocks.handler import backend_configs, backends
from distlocks.logs import log_expected
from distlocks.redaction import escape_control, redact

logger = logging.getLogger(__name__)

OK = "ok"
EXPIRING = "expiring"
STUCK = "stuck"
ORPHANED = "orphaned"
KEPT = "kept"
#: Most severe first: the order of the status sort.
STATUSES = (ORPHANED, STUCK, EXPIRING, KEPT, OK)
#: Less than this fraction of the ttl left: an auto-renewed lease would have been extended.
EXPIRING_FRACTION = 1 / 3
#: Upper bound of locks read per backend for one listing; beyond it the listing is
#: marked truncated rather than exhausting memory or time.
DEFAULT_LIMIT = 100_000
#: Backends read at the same time by one listing, at most.
MAX_READERS = 8
#: What a row can be: a plain lock, or a permit of one of these kinds.
LOCK = "lock"
KINDS = (LOCK, SEMAPHORE, READ, WRITE)
PERMIT_KINDS = frozenset({SEMAPHORE, READ, WRITE})

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
    def kind(self) -> str:
        """``"lock"``, or the kind of permit: ``"semaphore"``, ``"read"``, ``"write"``."""
        kind = self.info.extra.get("kind")
        return kind if kind in PERMIT_KINDS else LOCK

    @property
    def is_permit(self) -> bool:
        return self.kind != LOCK

    @property
    def ref(self) -> dict[str, str]:
        """What identifies this row among the others (query parameters of its page):
        the backend and name, and for a permit its kind and its holder's owner id."""
        if not self.is_permit:
            return {"backend": self.backend, "name": self.name}
        return {
            "backend": self.backend,
            "name": self.name,
            "kind": self.kind,
            "owner": self.info.owner,
        }

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
            "kind": self.kind,
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
    if info.extra.get("kept"):
        left = (info.expires_at - now).total_seconds() if info.expires_at else None
        return KEPT, (
            "kept on purpose after its holder finished (lock_at_least_for / release_after)"
            + ("" if left is None else f": it ends in {format_seconds(max(0.0, left))}")
        )
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


# A listed lock is kept as one flat tuple of plain values (strings, numbers,
# datetimes): the garbage collector stops tracking such a tuple the first time it sees
# it, where objects per lock would stay tracked: with 10,000 locks, every full
# collection of the process would then walk them, which cost more than reading them.
#
# Its first fields are what the listing itself needs of every lock (the search, the
# status filter and counts, every sort): the LockInfo fields but the extra details,
# with the times as sort keys (microseconds since the epoch), then its status, other
# aliases (joined by NUL) and Celery task id. The rest is what makes its LockInfo when
# a page shows the row, in one of two forms:
#
# * from a backend's lock summaries (see _listing()): the reason is None, worked out
#   with the LockInfo on demand, and the last field is the holder's extra details as
#   the JSON text stored, parsed on demand;
# * from a LockInfo: the reason, None, the two datetimes as the backend gave them, then
#   the extra details as key, value, key, value...
#
# So a listing of 100,000 Redis locks builds no datetime, parses no JSON and formats
# no reason for them: only for the rows of the page shown.
Row = tuple[Any, ...]
_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(LockInfo))
(_NAME, _BACKEND, _OWNER, _TOKEN, _HOST, _PID, _THREAD, _ACQUIRED, _EXPIRES, _TTL, _RENEWALS,
 _WAITERS) = range(12)  # fmt: skip
assert _INFO_FIELDS == (
    "name", "backend", "owner", "fencing_token", "host", "pid", "thread", "acquired_at",
    "expires_at", "ttl", "renewals", "waiters", "extra",
)  # fmt: skip
_STATUS, _ALSO, _TASK, _REASON, _RAW, _ACQUIRED_AT, _EXPIRES_AT, _EXTRA = range(12, 20)

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)


def _micros(moment: dt.datetime | None) -> int | float | None:
    """The sort key of a time: microseconds since the epoch."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        return moment.timestamp() * 1e6  # local time, as datetime reads a naive one
    return (moment - _EPOCH) // _MICROSECOND


def _row(info: LockInfo, status: str, reason: str, also: str) -> Row:
    """The row of a lock read as a LockInfo."""
    extra = info.extra
    row = (
        info.name, info.backend, info.owner, info.fencing_token, info.host, info.pid,
        info.thread, _micros(info.acquired_at), _micros(info.expires_at), info.ttl,
        info.renewals, info.waiters, status, also,
        str(extra.get("celery_task_id") or "") if extra else "", reason, None,
        info.acquired_at, info.expires_at,
    )  # fmt: skip
    if not extra:
        return row
    flat = list(row)
    for item in extra.items():
        flat += item
    return tuple(flat)


#: A backend's optional lock summaries: the positions in each tuple (see _listing()).
(_S_NAME, _S_OWNER, _S_TOKEN, _S_HOST, _S_PID, _S_THREAD, _S_ACQUIRED, _S_EXPIRES, _S_TTL,
 _S_RENEWALS, _S_WAITERS, _S_EXTRA) = range(12)  # fmt: skip


def _listing(backend: BaseBackend) -> Iterator[LockInfo | tuple[Any, ...]]:
    """What a backend lists: its lock summaries where it has them, else its LockInfos.

    A backend may have an ``iter_lock_summaries()`` method (RedisBackend does): the
    same locks as ``iter_locks()``, each as a tuple of plain values, cheaper to make
    and to keep when there are many::

        (name, owner, fencing_token, host, pid, thread, acquired_ms, expires_ms, ttl,
         renewals, waiters, extra)

    with the times as integer milliseconds since the epoch (or None), ``extra`` the
    holder's details as JSON text (see :func:`~distlocks.backends.base.holder_details`)
    and the rest as the :class:`LockInfo` fields of the same names; it may also yield
    LockInfo objects (its permits, say). A backend without the method is listed
    through ``iter_locks()``; so are the command's and the page's detail views, which
    read one lock with ``inspect()``.
    """
    summaries = getattr(backend, "iter_lock_summaries", None)
    return summaries() if summaries is not None else backend.iter_locks()


def _summary_info(summary: Sequence[Any], backend: str) -> LockInfo:
    """The LockInfo a lock summary stands for (what iter_locks() would have yielded)."""
    acquired, expires = summary[_S_ACQUIRED], summary[_S_EXPIRES]
    return LockInfo(
        name=summary[_S_NAME], backend=backend, owner=summary[_S_OWNER],
        fencing_token=summary[_S_TOKEN], host=summary[_S_HOST], pid=summary[_S_PID],
        thread=summary[_S_THREAD],
        acquired_at=None if acquired is None else _EPOCH + dt.timedelta(milliseconds=acquired),
        expires_at=None if expires is None else _EPOCH + dt.timedelta(milliseconds=expires),
        ttl=summary[_S_TTL], renewals=summary[_S_RENEWALS], waiters=summary[_S_WAITERS],
        extra=holder_details(summary[_S_EXTRA]),
    )  # fmt: skip


def _needs_details(extra: str) -> bool:
    """Whether a summary's extra details (JSON text) may hold something the listing
    reads (a Celery task id, a PostgreSQL session), or hide it in an escape."""
    return (
        bool(extra)
        and extra != "{}"
        and (
            "celery_task_id" in extra
            or "backend_pid" in extra
            or "kept" in extra
            or "\\" in extra
        )
    )


@dataclass(frozen=True)
class _Context:
    """What the statuses of a listing were worked out with: the same again for a row
    made into a LiveLock later gives it the same status, and its reason."""

    now: dt.datetime
    stuck_after: float
    pid_gone: Callable[[int], bool]


def _summary_row(
    summary: Sequence[Any], backend: str, also: str, now_us: int, context: _Context
) -> Row:
    """The row of a lock summary: its status worked out as :func:`classify` works it out
    from the LockInfo, on numbers (no datetime, no JSON, no reason text)."""
    (name, owner, token, host, pid, thread, acquired, expires, ttl, renewals, waiters,
     extra) = summary  # fmt: skip
    if _needs_details(extra):
        info = _summary_info(summary, backend)
        status, reason = classify(
            info, now=context.now, stuck_after=context.stuck_after, pid_gone=context.pid_gone
        )
        return _row(info, status, reason, also)
    if acquired is not None:
        acquired *= 1000
    if expires is not None:
        expires *= 1000
    status = OK
    if host == _HOSTNAME and pid is not None and context.pid_gone(pid):
        status = ORPHANED
    elif expires is not None and ttl and (expires - now_us) / 1_000_000 < ttl * EXPIRING_FRACTION:
        status = ORPHANED if renewals > 0 else EXPIRING
        if (
            status == EXPIRING
            and acquired is not None
            and (now_us - acquired) / 1_000_000 > context.stuck_after
        ):
            status = STUCK
    elif acquired is not None and (now_us - acquired) / 1_000_000 > context.stuck_after:
        status = STUCK
    return (
        name, backend, owner, token, host, pid, thread, acquired, expires, ttl, renewals,
        waiters, status, also, "", None, extra,
    )  # fmt: skip


def _also(row: Row) -> tuple[str, ...]:
    return tuple(row[_ALSO].split("\x00")) if row[_ALSO] else ()


def _live(row: Row, context: _Context | None = None) -> LiveLock:
    if row[_REASON] is None:  # from a summary: its LockInfo and reason made now
        assert context is not None, "a summary's row is made into a LiveLock by its listing"
        summary = (
            row[_NAME], row[_OWNER], row[_TOKEN], row[_HOST], row[_PID], row[_THREAD],
            None if row[_ACQUIRED] is None else row[_ACQUIRED] // 1000,
            None if row[_EXPIRES] is None else row[_EXPIRES] // 1000,
            row[_TTL], row[_RENEWALS], row[_WAITERS], row[_RAW],
        )  # fmt: skip
        info = _summary_info(summary, row[_BACKEND])
        reason = ""
        if row[_STATUS] != OK:
            reason = classify(
                info, now=context.now, stuck_after=context.stuck_after, pid_gone=context.pid_gone
            )[1]
        return LiveLock(info, row[_STATUS], reason, _also(row))
    info = LockInfo(
        name=row[_NAME], backend=row[_BACKEND], owner=row[_OWNER], fencing_token=row[_TOKEN],
        host=row[_HOST], pid=row[_PID], thread=row[_THREAD], acquired_at=row[_ACQUIRED_AT],
        expires_at=row[_EXPIRES_AT], ttl=row[_TTL], renewals=row[_RENEWALS],
        waiters=row[_WAITERS], extra=dict(zip(row[_EXTRA::2], row[_EXTRA + 1 :: 2], strict=True)),
    )  # fmt: skip
    return LiveLock(info, row[_STATUS], row[_REASON], _also(row))


class Rows(Sequence[LiveLock]):
    """Listed rows, seen as :class:`LiveLock` objects made when asked for: a page of a
    listing makes a page of them."""

    def __init__(self, rows: list[Row], context: _Context | None = None) -> None:
        self.rows = rows
        self.context = context

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[LiveLock]:
        context = self.context
        return (_live(row, context) for row in self.rows)

    @overload
    def __getitem__(self, index: int) -> LiveLock: ...

    @overload
    def __getitem__(self, index: slice) -> list[LiveLock]: ...

    def __getitem__(self, index: int | slice) -> LiveLock | list[LiveLock]:
        if isinstance(index, slice):
            return [_live(row, self.context) for row in self.rows[index]]
        return _live(self.rows[index], self.context)


@dataclass(frozen=True)
class Selection:
    """One view of a snapshot: the rows a search, filters and sort leave, in order."""

    rows: Rows
    #: Status -> rows of the search (before the status filter): the sidebar's counts.
    counts: Mapping[str, int]
    #: Rows of the search before the status filter.
    searched: int


@dataclass
class Snapshot:
    """The live locks of some backends at one moment, and what went wrong reading them."""

    #: When it was read (wall clock, for display).
    taken_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    #: The locks, as tuples (see :data:`Row`); :attr:`locks` has them as objects.
    rows: list[Row] = field(default_factory=list, repr=False)
    #: alias -> message, for each backend that could not be read.
    errors: dict[str, str] = field(default_factory=dict)
    #: Aliases whose listing stopped at the limit.
    truncated: list[str] = field(default_factory=list)
    #: alias -> what its backend said about the listing itself, for the operator (a
    #: Redis listing index found lost and rebuilt, say); its locks are listed all the same.
    notes: dict[str, list[str]] = field(default_factory=dict)
    #: Every alias asked for, in settings order.
    aliases: list[str] = field(default_factory=list)
    #: The moment, threshold and process checks the statuses were worked out with (the
    #: rows of lock summaries need them again to be shown; see Row).
    context: _Context | None = field(default=None, repr=False, compare=False)
    #: Views already worked out: (query, status, backend, order) -> Selection.
    _views: dict[tuple[str, str, str, str], Selection] = field(
        default_factory=dict, repr=False, compare=False
    )

    @functools.cached_property
    def locks(self) -> list[LiveLock]:
        """Every lock, as :class:`LiveLock` objects (made on first use)."""
        context = self.context
        return [_live(row, context) for row in self.rows]

    def counts(self) -> dict[str, dict[str, int]]:
        """alias -> status -> number of locks."""
        counts = {alias: dict.fromkeys(STATUSES, 0) for alias in self.aliases}
        for row in self.rows:
            counts.setdefault(row[_BACKEND], dict.fromkeys(STATUSES, 0))[row[_STATUS]] += 1
        return counts

    def select(
        self, *, query: str = "", status: str = "", backend: str = "", order: str = "name"
    ) -> Selection:
        """:func:`select` over this snapshot, remembered: another page of the same view,
        or the same view again (an automatic reload), costs nothing but its page."""
        key = (query, status, backend, order)
        found = self._views.get(key)
        if found is None:
            searched = self._views.get((query, "", backend, order))
            if searched is None:
                rows = _select_rows(self.rows, query=query, backend=backend, order=order)
                searched = Selection(Rows(rows, self.context), _count_rows(rows), len(rows))
                self._remember((query, "", backend, order), searched)
            found = searched
            if status:
                rows = [row for row in searched.rows.rows if row[_STATUS] == status]
                found = Selection(Rows(rows, self.context), searched.counts, searched.searched)
                self._remember(key, found)
        return found

    def _remember(self, key: tuple[str, str, str, str], selection: Selection) -> None:
        # Requests share a snapshot: a bounded memo, replaced whole (no lock needed).
        views = self._views if len(self._views) < 32 else {}
        views[key] = selection
        self._views = views


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
    """The error as operators see it: its type and message, no password, no control
    characters."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return escape_control(redact(text))


def collect(
    aliases: Iterable[str] | None = None,
    *,
    limit: int = DEFAULT_LIMIT,
    now: dt.datetime | None = None,
) -> Snapshot:
    """Read the live locks of ``aliases`` (default: every configured backend).

    One pass per backend, the backends read at the same time (each mostly waits for its
    server); a failing backend is recorded and skipped. Aliases that point at the same
    server see the same locks: each lock is listed once, under the first of them in
    settings order, with the others in :attr:`LiveLock.also`, and that server is read
    once. With many locks this is the whole cost of a listing, so each lock is kept as
    one :data:`Row`.
    """
    now = now or dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        now = now.replace(tzinfo=dt.UTC)  # the servers' times are in UTC
    stuck_after = conf.STUCK_AFTER
    gone: dict[int, bool] = {}

    def pid_gone(pid: int) -> bool:  # one system call per holder process, not per lock
        if pid not in gone:
            gone[pid] = _pid_gone(pid)
        return gone[pid]

    context = _Context(now, stuck_after, pid_gone)
    now_us = (now - _EPOCH) // _MICROSECOND
    snapshot = Snapshot(
        aliases=list(configured_aliases() if aliases is None else aliases), context=context
    )

    sources = {alias: _source(alias) for alias in snapshot.aliases}
    first: dict[Any, str] = {}  # where -> the alias it is read through
    for alias in snapshot.aliases:
        where = sources[alias]
        if where is not None and where not in first:
            first[where] = alias
    readers = [
        alias
        for alias in snapshot.aliases
        if sources[alias] is None or first[sources[alias]] == alias
    ]

    def read(alias: str) -> tuple[list[Row], bool, str, list[str]]:
        """The rows of one backend, whether the limit cut them short, its error and
        its notes."""
        where = sources[alias]
        also = "\x00".join(
            other
            for other in snapshot.aliases
            if other != alias and where is not None and sources[other] == where
        )
        found: list[Row] = []
        notes: list[str] = []
        append = found.append
        try:
            for item in _listing(get(alias)):
                if type(item) is tuple:
                    if len(found) >= limit:
                        return found, True, "", notes
                    append(_summary_row(item, alias, also, now_us, context))
                    continue
                if isinstance(item, str):
                    notes.append(escape_control(redact(item)))
                    continue
                if len(found) >= limit:
                    return found, True, "", notes
                assert isinstance(item, LockInfo)
                status, reason = classify(item, now=now, stuck_after=stuck_after, pid_gone=pid_gone)
                append(_row(item, status, reason, also))
        except Exception as exc:
            # The page and the command must still answer: report this backend, go on.
            log_expected(logger, exc, "Could not list the locks of backend %r", alias)
            return found, False, describe_error(exc), notes
        return found, False, "", notes

    if len(readers) > 1:
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(len(readers), MAX_READERS), thread_name_prefix="distlocks-list"
        ) as pool:
            results = dict(zip(readers, pool.map(read, readers), strict=True))
    else:
        results = {alias: read(alias) for alias in readers}
    for alias in snapshot.aliases:
        where = sources[alias]
        if alias not in results:
            # The same server and key prefix as an alias already read: same locks.
            error = results[first[where]][2]
            if error:
                snapshot.errors[alias] = error
            continue
        found, truncated, error, notes = results[alias]
        if truncated:
            snapshot.truncated.append(alias)
        if error:
            snapshot.errors[alias] = error
        if notes:
            snapshot.notes[alias] = notes
        snapshot.rows.extend(found)
    classes = [where[0] for where in first]
    if len(set(classes)) < len(classes):
        # Two aliases of one class that look different may still be one server.
        snapshot.rows = _merge_aliases(snapshot.rows)
    return snapshot


@dataclass
class Tally:
    """The live locks of some backends counted, not kept: what metrics need of a
    listing (see :func:`tally`), exact at any number of locks."""

    #: Every alias asked for, in settings order.
    aliases: list[str] = field(default_factory=list)
    #: alias -> status -> number of locks (every status present).
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: alias -> seconds the longest-held of its locks has been held (0.0 if none).
    oldest: dict[str, float] = field(default_factory=dict)
    #: alias -> message, for each backend that could not be read.
    errors: dict[str, str] = field(default_factory=dict)
    #: alias -> notes of its backend about the listing (see :attr:`Snapshot.notes`).
    notes: dict[str, list[str]] = field(default_factory=dict)
    #: alias -> locks counted (read from its backend: aliases of one server have none).
    seen: dict[str, int] = field(default_factory=dict)


def tally(aliases: Iterable[str] | None = None, *, now: dt.datetime | None = None) -> Tally:
    """Count the live locks of ``aliases`` (default: every configured backend) by
    status, and find the longest-held, without keeping them: each lock is classified
    as :func:`collect` classifies it, counted and dropped, so memory does not grow
    with the number of locks and no limit applies (a scrape of 120,000 locks counts
    120,000). Aliases of one server are counted once, under the first, as
    :func:`collect` lists them."""
    now = now or dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        now = now.replace(tzinfo=dt.UTC)
    gone: dict[int, bool] = {}

    def pid_gone(pid: int) -> bool:
        if pid not in gone:
            gone[pid] = _pid_gone(pid)
        return gone[pid]

    context = _Context(now, conf.STUCK_AFTER, pid_gone)
    now_us = (now - _EPOCH) // _MICROSECOND
    result = Tally(aliases=list(configured_aliases() if aliases is None else aliases))
    sources = {alias: _source(alias) for alias in result.aliases}
    first: dict[Any, str] = {}
    for alias in result.aliases:
        where = sources[alias]
        if where is not None and where not in first:
            first[where] = alias
    readers = [a for a in result.aliases if sources[a] is None or first[sources[a]] == a]
    classes = [where[0] for where in first]
    # Two aliases of one class that look different may still be one server: the
    # locks counted are then remembered (name and owner only), as collect() merges.
    counted: set[tuple[str, str]] | None = set() if len(set(classes)) < len(classes) else None

    def count(alias: str) -> tuple[dict[str, int], float, str, list[str], int]:
        counts = dict.fromkeys(STATUSES, 0)
        oldest = 0.0
        notes: list[str] = []
        seen = 0
        try:
            for item in _listing(get(alias)):
                if type(item) is tuple:
                    row = _summary_row(item, alias, "", now_us, context)
                    status, acquired, key = row[_STATUS], row[_ACQUIRED], (row[_NAME], row[_OWNER])
                elif isinstance(item, str):
                    notes.append(escape_control(redact(item)))
                    continue
                else:
                    assert isinstance(item, LockInfo)
                    status = classify(item, now=now, stuck_after=context.stuck_after,
                                      pid_gone=pid_gone)[0]  # fmt: skip
                    acquired, key = _micros(item.acquired_at), (item.name, item.owner)
                if counted is not None:
                    if key in counted:
                        continue
                    counted.add(key)
                seen += 1
                counts[status] += 1
                if acquired is not None and (now_us - acquired) / 1_000_000 > oldest:
                    oldest = (now_us - acquired) / 1_000_000
        except Exception as exc:
            log_expected(logger, exc, "Could not list the locks of backend %r", alias)
            return counts, oldest, describe_error(exc), notes, seen
        return counts, oldest, "", notes, seen

    if len(readers) > 1 and counted is None:
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(len(readers), MAX_READERS), thread_name_prefix="distlocks-count"
        ) as pool:
            results = dict(zip(readers, pool.map(count, readers), strict=True))
    else:
        # In settings order, so a lock seen through two aliases counts under the first.
        results = {alias: count(alias) for alias in readers}
    for alias in result.aliases:
        result.counts[alias] = dict.fromkeys(STATUSES, 0)
        result.oldest[alias] = 0.0
        if alias not in results:
            error = results[first[sources[alias]]][2]
            if error:
                result.errors[alias] = error
            continue
        counts, oldest, error, notes, seen = results[alias]
        result.counts[alias], result.oldest[alias], result.seen[alias] = counts, oldest, seen
        if error:
            result.errors[alias] = error
        if notes:
            result.notes[alias] = notes
    return result


class SnapshotCache:
    """The last snapshot of each set of aliases, reused for ``ttl`` seconds.

    Paging, sorting, searching and filtering a listing then cost one page of work, not
    a new pass over every lock; so does a reload by any viewer within ``ttl``. When a
    snapshot is due, one request reads the servers and concurrent ones wait for its
    result instead of each reading them too. A force release empties it; the page of
    one lock always reads the server.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Any, tuple[float, Snapshot]] = {}
        self._readers: dict[Any, threading.Lock] = {}

    def get(
        self,
        aliases: Sequence[str],
        ttl: float,
        limit: int = DEFAULT_LIMIT,
        *,
        refresh: bool = False,
    ) -> Snapshot:
        """The snapshot of ``aliases`` if younger than ``ttl`` seconds, else a new one
        (``refresh``: a new one in any case, which the next calls then reuse)."""
        key = (tuple(aliases), limit, conf.STUCK_AFTER)
        asked = time.monotonic()
        with self._lock:
            found = self._entries.get(key)
            if not refresh and found is not None and asked - found[0] < ttl:
                return found[1]
            reader = self._readers.setdefault(key, threading.Lock())
        with reader:
            # Another request may have read them while this one waited (a read begun
            # after this call was made is fresh enough, even for a refresh).
            with self._lock:
                found = self._entries.get(key)
            if found is not None and (
                found[0] >= asked or (not refresh and asked - found[0] < ttl)
            ):
                return found[1]
            began = time.monotonic()  # its age counts from the start of the read
            snapshot = collect(aliases, limit=limit)
            with self._lock:
                if len(self._entries) > 32:
                    self._entries.clear()
                self._entries[key] = (began, snapshot)
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


def _merge_aliases(rows: list[Row]) -> list[Row]:
    # The owner is a random id per acquisition: the same (name, owner) read through
    # two aliases is one lock.
    first: dict[tuple[str, str], int] = {}
    merged: list[Row] = []
    for row in rows:
        key = (row[_NAME], row[_OWNER])
        index = first.get(key)
        if index is None:
            first[key] = len(merged)
            merged.append(row)
            continue
        kept = merged[index]
        if row[_BACKEND] != kept[_BACKEND] and row[_BACKEND] not in _also(kept):
            also = "\x00".join((*_also(kept), row[_BACKEND]))
            merged[index] = (*kept[:_ALSO], also, *kept[_ALSO + 1 :])
    return merged


def check_ref(kind: str | None, owner: str | None) -> tuple[str, str]:
    """``(kind, owner)`` of a row reference, checked: ``kind`` is ``"lock"`` (or empty)
    or a permit kind, and a permit names its holder's owner id (a lock needs none).
    ValueError, saying what to change, otherwise."""
    kind = kind or LOCK
    owner = owner or ""
    if kind not in KINDS:
        raise ValueError(f"Unknown kind {kind!r}: use {', '.join(KINDS)}.")
    if kind == LOCK:
        if owner:
            raise ValueError(
                "A lock is identified by its name alone: drop the owner, or give the kind "
                "of permit it belongs to (semaphore, read or write)."
            )
    elif not owner:
        raise ValueError(
            f"Several holders may share a {kind} name: give the owner id of the one meant."
        )
    return kind, owner


def describe_kind(kind: str) -> str:
    """``lock``, ``semaphore permit``, ``read lease``, ``write lease``."""
    return {SEMAPHORE: "semaphore permit", READ: "read lease", WRITE: "write lease"}.get(
        kind, "lock"
    )


def _holder_info(backend: BaseBackend, name: str, kind: str, owner: str) -> LockInfo | None:
    """What the server shows of ``name`` (a lock), or of ``owner``'s permit of ``kind``."""
    if kind == LOCK:
        return backend.inspect(name)
    for info in backend.permit_holders(kind, name):
        if info.owner == owner and info.extra.get("kind") == kind:
            return info
    return None


def inspect(alias: str, name: str, kind: str = LOCK, owner: str = "") -> LiveLock | None:
    """The live lock ``name`` on ``alias``, or the permit of ``kind`` that ``owner``
    holds on it (None when free, or gone); errors propagate (ValueError for a bad
    reference, see :func:`check_ref`)."""
    kind, owner = check_ref(kind, owner)
    info = _holder_info(get(alias), name, kind, owner)
    return None if info is None else LiveLock(info, *classify(info))


def complete(items: Sequence[LiveLock]) -> list[LiveLock]:
    """Fill in what a backend's listing leaves out (e.g. waiters on Redlock) for a few
    rows, one ``inspect()`` each: for one page of a listing, never the whole of it. A
    backend that counts the waiters of many locks at once (``count_waiters(names)``,
    as a Redis backend listed from its index does) is asked once for its locks."""
    counted = _count_waiters(items)
    done = []
    for item in items:
        if item.info.waiters is not None:
            done.append(item)
            continue
        count = counted.get((item.backend, item.name))
        if count is not None and not item.is_permit:
            done.append(
                dataclasses.replace(item, info=dataclasses.replace(item.info, waiters=count))
            )
            continue
        try:
            owner = item.info.owner if item.is_permit else ""
            fresh = inspect(item.backend, item.name, item.kind, owner)
        except Exception:
            logger.debug("Could not inspect %r on %r", item.name, item.backend, exc_info=True)
            fresh = None
        # A lock freed meanwhile keeps its listed details.
        if fresh is not None and fresh.info.owner == item.info.owner:
            item = dataclasses.replace(fresh, also=item.also)
        done.append(item)
    return done


def _count_waiters(items: Sequence[LiveLock]) -> dict[tuple[str, str], int]:
    """(alias, name) -> waiters, for the locks of ``items`` without a count whose backend
    counts many at once; a backend that fails is left to ``inspect()``."""
    names: dict[str, list[str]] = {}
    for item in items:
        if item.info.waiters is None and not item.is_permit:
            names.setdefault(item.backend, []).append(item.name)
    counted: dict[tuple[str, str], int] = {}
    for alias, wanted in names.items():
        try:
            count = getattr(get(alias), "count_waiters", None)
            if count is not None:
                counted.update(zip(((alias, name) for name in wanted), count(wanted), strict=True))
        except Exception:
            logger.debug("Could not count the waiters on %r", alias, exc_info=True)
    return counted


@dataclass(frozen=True)
class ForceReleased:
    """What :func:`force_release` did."""

    alias: str
    name: str
    #: The holder just before (None: the lock was already free).
    before: LiveLock | None
    #: True when the call freed a held lock (or evicted the permit's holder).
    released: bool
    #: The fencing counter afterwards (for a read-write lock, of its writes): every
    #: token up to it is now stale. None for a semaphore, which issues no tokens.
    counter: int | None
    #: ``"lock"``, or the kind of the permit evicted.
    kind: str = LOCK
    #: The owner id of the permit evicted ("" for a lock).
    owner: str = ""


class TokenChanged(Exception):
    """The lock changed hands since the operator looked at it (for a permit: its
    holder is no longer there)."""

    def __init__(self, current: LiveLock | None) -> None:
        self.current = current
        super().__init__("the lock changed hands since it was shown")


def force_release(
    alias: str,
    name: str,
    *,
    kind: str = LOCK,
    owner: str = "",
    expected_token: int | None = None,
    user: Any = None,
    via: str = "admin",
) -> ForceReleased:
    """Free ``name`` on ``alias`` whoever holds it, advancing its fencing counter; or,
    with a permit ``kind`` and ``owner``, evict that one holder of the semaphore or
    read-write lock ``name`` (the others keep theirs).

    With ``expected_token``, refuse (:class:`TokenChanged`) when the lock is no longer
    held under that token: the operator confirmed the eviction of one holder, not of
    whoever took the lock since. A permit is refused when its owner no longer holds
    it (nothing of it is left to evict). Sends ``lock_force_released``.
    """
    kind, owner = check_ref(kind, owner)
    backend = get(alias)
    before = inspect(alias, name, kind, owner)
    current_token = None if before is None else before.info.fencing_token
    if kind != LOCK and before is None:
        raise TokenChanged(None)
    if expected_token is not None and current_token != expected_token:
        raise TokenChanged(before)
    if kind != LOCK:
        assert before is not None
        released = backend.force_release_holder(before.info)
    elif expected_token is not None:
        # The server compares the token and evicts in one step: if the lock changed
        # hands since it was read above, nothing is done.
        released = backend.force_release(name, expected_token)
        if not released:
            snapshots.clear()
            raise TokenChanged(inspect(alias, name))
    else:
        released = backend.force_release(name)
    if released and before is not None:
        _wait_evicted(backend, name, kind, before.info.owner)
    snapshots.clear()
    if not released:
        # Nothing was held, so nothing was written: no log line, no signal.
        return ForceReleased(alias, name, before, False, None, kind, owner)
    try:
        counter: int | None
        if kind == LOCK:
            counter = backend.fencing_counter(name)
        else:
            counter = backend.permit_counter(name) if kind in (READ, WRITE) else None
    except Exception:
        logger.warning("Could not read the fencing counter of %r on %r", name, alias, exc_info=True)
        counter = None
    logger.warning(
        "%s %s on backend %r force-released via %s by %s (holder before: %s, owner %s, token %s)",
        describe_kind(kind).capitalize(), escape_control(repr(name)), alias, via,
        escape_control(str(user or "-")),
        escape_control(before.holder) if before else "none",
        before.info.owner if before else "-",
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
    return ForceReleased(alias, name, before, released, counter, kind, owner)


#: Longest wait for an evicted holder to disappear from the server's view.
EVICTION_WAIT = 5.0


def _wait_evicted(backend: BaseBackend, name: str, kind: str, owner: str) -> None:
    """Return once the server no longer shows ``owner`` holding ``name`` (or its
    permit of ``kind``).

    A backend may evict asynchronously (PostgreSQL signals the holder's session to
    end, and its locks go when it has exited): the page shown next, and the caller,
    must not still see the evicted holder.
    """
    deadline = time.monotonic() + EVICTION_WAIT
    while True:
        try:
            info = _holder_info(backend, name, kind, owner)
        except Exception:
            return  # nothing to wait on that can be read
        if info is None or info.owner != owner:
            return
        if time.monotonic() >= deadline:
            logger.warning(
                "%s %r on backend %r still shows its evicted holder after %ss",
                describe_kind(kind).capitalize(), name, backend.alias, EVICTION_WAIT,
            )  # fmt: skip
            return
        time.sleep(0.01)


# -- listing: search, filters, sort, pages -----------------------------------------


def _holder_of(row: Row) -> str:
    parts = [row[_HOST] or "?"]
    if row[_PID] is not None:
        parts.append(f"pid {row[_PID]}")
    if row[_THREAD]:
        parts.append(row[_THREAD])
    return " ".join(parts)


_STATUS_RANK = {status: rank for rank, status in enumerate(STATUSES)}

#: Sort keys: query value -> (key function of a row, reversed). Times sort by the
#: stored instant (held longest = acquired earliest), which needs no clock read per row.
SORTS: dict[str, tuple[Callable[[Row], Any], bool]] = {
    "name": (operator.itemgetter(_NAME), False),
    "backend": (operator.itemgetter(_BACKEND, _ALSO), False),
    "holder": (_holder_of, False),
    "acquired": (operator.itemgetter(_ACQUIRED), False),
    "held": (operator.itemgetter(_ACQUIRED), True),
    "expires": (operator.itemgetter(_EXPIRES), False),
    "token": (operator.itemgetter(_TOKEN), False),
    "renewals": (operator.itemgetter(_RENEWALS), False),
    "waiters": (operator.itemgetter(_WAITERS), False),
    "status": (lambda row: _STATUS_RANK[row[_STATUS]], False),
}
#: Ties keep name order; holders of one semaphore or read-write lock share its name,
#: and their owner ids break those ties.
_BASE_ORDER = operator.itemgetter(_NAME, _BACKEND, _OWNER)


def _base_sort(rows: list[Row]) -> None:
    """Sort ``rows`` in :data:`_BASE_ORDER`: by name alone (a sort on one text, several
    times faster than on tuples) unless names repeat, as permits' do."""
    rows.sort(key=operator.itemgetter(_NAME))
    names = [row[_NAME] for row in rows]
    if any(map(operator.eq, names, itertools.islice(names, 1, None))):
        rows.sort(key=_BASE_ORDER)


def matches(item: LiveLock, query: str) -> bool:
    """Case-insensitive search in the name, the holder's host and its Celery task id."""
    return _matches(_row(item.info, item.status, item.reason, ""), query.casefold())


def _matches(row: Row, query: str) -> bool:
    return any(query in text.casefold() for text in (row[_NAME], row[_HOST], row[_TASK]))


def _select_rows(
    rows: Iterable[Row], *, query: str = "", status: str = "", backend: str = "", order: str = ""
) -> list[Row]:
    query = query.casefold()
    chosen = [
        row
        for row in rows
        if (not status or row[_STATUS] == status)
        and (not backend or row[_BACKEND] == backend or backend in _also(row))
        and (not query or _matches(row, query))
    ]
    name, flip = order.lstrip("-"), order.startswith("-")
    if name not in SORTS:
        name, flip = "name", False
    _base_sort(chosen)
    if name == "name":
        if flip:
            chosen.reverse()
        return chosen
    key, reverse = SORTS[name]
    descending = flip != reverse
    keyed = [(key(row), row) for row in chosen]
    # Rows without a value go last.
    present = [pair for pair in keyed if pair[0] is not None]
    present.sort(key=operator.itemgetter(0), reverse=descending)
    return [row for _, row in present] + [row for k, row in keyed if k is None]


def select(
    items: Iterable[LiveLock],
    *,
    query: str = "",
    status: str = "",
    backend: str = "",
    order: str = "name",
) -> list[LiveLock]:
    """Filter and sort; ``order`` is a :data:`SORTS` key, ``-`` in front for descending."""
    rows = [_row(item.info, item.status, item.reason, "\x00".join(item.also)) for item in items]
    chosen = _select_rows(rows, query=query, status=status, backend=backend, order=order)
    return [_live(row) for row in chosen]


def _count_rows(rows: Iterable[Row]) -> Mapping[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for row in rows:
        counts[row[_STATUS]] += 1
    return counts


def status_counts(items: Iterable[LiveLock]) -> Mapping[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for item in items:
        counts[item.status] += 1
    return counts
