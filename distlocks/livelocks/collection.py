"""Reading the live locks of the configured backends: :func:`collect` (a
:class:`Snapshot` of rows), :func:`tally` (counts only, for metrics) and the
:class:`SnapshotCache` the admin page reuses.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import functools
import logging
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distlocks.backends.base import BaseBackend, LockInfo
from distlocks.backends.capabilities import Listing, NotSupported, require
from distlocks.conf import conf
from distlocks.handler import backend_configs, backends
from distlocks.livelocks.rows import (
    _ACQUIRED,
    _ALSO,
    _BACKEND,
    _EPOCH,
    _MICROSECOND,
    _NAME,
    _OWNER,
    _STATUS,
    Row,
    _also,
    _Context,
    _listing,
    _live,
    _micros,
    _row,
    _summary_row,
)
from distlocks.livelocks.selection import Rows, Selection, _count_rows, _select_rows
from distlocks.livelocks.status import STATUSES, LiveLock, _pid_gone, classify
from distlocks.logs import log_expected
from distlocks.redaction import escape_control, redact

# The package's one logger, as before the split: its name is what logging settings
# and operators' filters know.
logger = logging.getLogger("distlocks.livelocks")


#: Upper bound of locks read per backend for one listing; beyond it the listing is
#: marked truncated rather than exhausting memory or time.
DEFAULT_LIMIT = 100_000
#: Backends read at the same time by one listing, at most.
MAX_READERS = 8


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
    #: alias -> the answer of a backend that cannot list its locks (it does not declare
    #: the Listing capability): not an error, and none of its locks are here.
    unlisted: dict[str, str] = field(default_factory=dict)
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


def unlisted(aliases: Iterable[str]) -> dict[str, str]:
    """alias -> the one answer of its backend, for the ``aliases`` whose backend cannot
    list its locks. A backend that cannot be built is not among them: reading it gives
    its error, as for any backend that fails."""
    found = {}
    for alias in aliases:
        try:
            backend = get(alias)
        except Exception:
            continue
        try:
            require(backend, Listing)
        except NotSupported as exc:
            found[alias] = escape_control(str(exc))
    return found


def describe_error(exc: BaseException) -> str:
    """The error as operators see it: its type and message, no password, no control
    characters."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # Drivers lay out their messages on several lines (libpq's "\n\tIs the server
    # running..."): one line here, rather than \x0a\x09 escapes in the banner.
    text = re.sub(r"[ \t]*[\r\n]+[ \t]*|\t+", " ", text)
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
    snapshot.unlisted = unlisted(snapshot.aliases)
    listed = [alias for alias in snapshot.aliases if alias not in snapshot.unlisted]

    sources = {alias: _source(alias) for alias in listed}
    first: dict[Any, str] = {}  # where -> the alias it is read through
    for alias in listed:
        where = sources[alias]
        if where is not None and where not in first:
            first[where] = alias
    readers = [a for a in listed if sources[a] is None or first[sources[a]] == a]

    def read(alias: str) -> tuple[list[Row], bool, str, list[str]]:
        """The rows of one backend, whether the limit cut them short, its error and
        its notes."""
        where = sources[alias]
        also = "\x00".join(
            other
            for other in listed
            if other != alias and where is not None and sources[other] == where
        )
        found: list[Row] = []
        notes: list[str] = []
        append = found.append
        try:
            for item in _listing(require(get(alias), Listing)):
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
    for alias in listed:
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
    #: alias -> the answer of a backend that cannot list (see :attr:`Snapshot.unlisted`):
    #: it has no counts, not zeros.
    unlisted: dict[str, str] = field(default_factory=dict)


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
    result.unlisted = unlisted(result.aliases)
    listed = [alias for alias in result.aliases if alias not in result.unlisted]
    sources = {alias: _source(alias) for alias in listed}
    first: dict[Any, str] = {}
    for alias in listed:
        where = sources[alias]
        if where is not None and where not in first:
            first[where] = alias
    readers = [a for a in listed if sources[a] is None or first[sources[a]] == a]
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
            for item in _listing(require(get(alias), Listing)):
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
    for alias in listed:
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
            # Read through the package, where callers (the tests' slow read, say)
            # may have replaced collect().
            from distlocks import livelocks

            snapshot = livelocks.collect(aliases, limit=limit)
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
