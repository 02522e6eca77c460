"""Search, filters and sort of listed rows: what a page of the listing shows."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from distlocks.livelocks.rows import (
    _ACQUIRED,
    _ALSO,
    _BACKEND,
    _EXPIRES,
    _HOST,
    _NAME,
    _OWNER,
    _PID,
    _RENEWALS,
    _STATUS,
    _TASK,
    _THREAD,
    _TOKEN,
    _WAITERS,
    Row,
    Rows,
    _also,
    _live,
    _row,
)
from distlocks.livelocks.status import STATUSES, LiveLock


@dataclass(frozen=True)
class Selection:
    """One view of a snapshot: the rows a search, filters and sort leave, in order."""

    rows: Rows
    #: Status -> rows of the search (before the status filter): the sidebar's counts.
    counts: Mapping[str, int]
    #: Rows of the search before the status filter.
    searched: int


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
