"""A listed lock as one flat tuple (:data:`Row`): made from a backend's lock summaries
or LockInfos, its status worked out on numbers, and made into a :class:`LiveLock`
only when a page shows it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from distlocks.backends.base import LockInfo, holder_details
from distlocks.backends.capabilities import Listing
from distlocks.livelocks.status import (
    _HOSTNAME,
    EXPIRING,
    EXPIRING_FRACTION,
    OK,
    ORPHANED,
    STUCK,
    LiveLock,
    classify,
)

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


def _listing(backend: Listing) -> Iterator[LockInfo | tuple[Any, ...]]:
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
            "celery_task_id" in extra or "backend_pid" in extra or "kept" in extra or "\\" in extra
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
