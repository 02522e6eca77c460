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

The package is split along its seams, and every name is importable from here as
before the split:

* :mod:`~distlocks.livelocks.status`: the statuses, :class:`LiveLock`, :func:`classify`;
* :mod:`~distlocks.livelocks.rows`: a listed lock as one flat tuple (:data:`Row`);
* :mod:`~distlocks.livelocks.selection`: search, filters and sort of a listing;
* :mod:`~distlocks.livelocks.collection`: :func:`collect`, :func:`tally`, the snapshot cache;
* :mod:`~distlocks.livelocks.release`: :func:`inspect`, :func:`complete`, :func:`force_release`.
"""

from __future__ import annotations

from distlocks.backends.base import READ, SEMAPHORE, WRITE, BaseBackend, LockInfo, holder_details
from distlocks.conf import conf
from distlocks.livelocks.collection import (
    DEFAULT_LIMIT,
    MAX_READERS,
    Snapshot,
    SnapshotCache,
    Tally,
    collect,
    configured_aliases,
    describe_error,
    get,
    logger,
    snapshots,
    tally,
)
from distlocks.livelocks.collection import (
    _merge_aliases as _merge_aliases,
)
from distlocks.livelocks.collection import (
    _source as _source,
)
from distlocks.livelocks.release import (
    EVICTION_WAIT,
    ForceReleased,
    TokenChanged,
    complete,
    force_release,
    inspect,
)
from distlocks.livelocks.release import (
    _count_waiters as _count_waiters,
)
from distlocks.livelocks.release import (
    _holder_info as _holder_info,
)
from distlocks.livelocks.release import (
    _wait_evicted as _wait_evicted,
)
from distlocks.livelocks.rows import (
    _ACQUIRED as _ACQUIRED,
)
from distlocks.livelocks.rows import (
    _ACQUIRED_AT as _ACQUIRED_AT,
)
from distlocks.livelocks.rows import (
    _ALSO as _ALSO,
)
from distlocks.livelocks.rows import (
    _BACKEND as _BACKEND,
)
from distlocks.livelocks.rows import (
    _EPOCH as _EPOCH,
)
from distlocks.livelocks.rows import (
    _EXPIRES as _EXPIRES,
)
from distlocks.livelocks.rows import (
    _EXPIRES_AT as _EXPIRES_AT,
)
from distlocks.livelocks.rows import (
    _EXTRA as _EXTRA,
)
from distlocks.livelocks.rows import (
    _HOST as _HOST,
)
from distlocks.livelocks.rows import (
    _INFO_FIELDS as _INFO_FIELDS,
)
from distlocks.livelocks.rows import (
    _MICROSECOND as _MICROSECOND,
)
from distlocks.livelocks.rows import (
    _NAME as _NAME,
)
from distlocks.livelocks.rows import (
    _OWNER as _OWNER,
)
from distlocks.livelocks.rows import (
    _PID as _PID,
)
from distlocks.livelocks.rows import (
    _RAW as _RAW,
)
from distlocks.livelocks.rows import (
    _REASON as _REASON,
)
from distlocks.livelocks.rows import (
    _RENEWALS as _RENEWALS,
)
from distlocks.livelocks.rows import (
    _S_ACQUIRED as _S_ACQUIRED,
)
from distlocks.livelocks.rows import (
    _S_EXPIRES as _S_EXPIRES,
)
from distlocks.livelocks.rows import (
    _S_EXTRA as _S_EXTRA,
)
from distlocks.livelocks.rows import (
    _S_HOST as _S_HOST,
)
from distlocks.livelocks.rows import (
    _S_NAME as _S_NAME,
)
from distlocks.livelocks.rows import (
    _S_OWNER as _S_OWNER,
)
from distlocks.livelocks.rows import (
    _S_PID as _S_PID,
)
from distlocks.livelocks.rows import (
    _S_RENEWALS as _S_RENEWALS,
)
from distlocks.livelocks.rows import (
    _S_THREAD as _S_THREAD,
)
from distlocks.livelocks.rows import (
    _S_TOKEN as _S_TOKEN,
)
from distlocks.livelocks.rows import (
    _S_TTL as _S_TTL,
)
from distlocks.livelocks.rows import (
    _S_WAITERS as _S_WAITERS,
)
from distlocks.livelocks.rows import (
    _STATUS as _STATUS,
)
from distlocks.livelocks.rows import (
    _TASK as _TASK,
)
from distlocks.livelocks.rows import (
    _THREAD as _THREAD,
)
from distlocks.livelocks.rows import (
    _TOKEN as _TOKEN,
)
from distlocks.livelocks.rows import (
    _TTL as _TTL,
)
from distlocks.livelocks.rows import (
    _WAITERS as _WAITERS,
)
from distlocks.livelocks.rows import (
    Row,
    Rows,
)
from distlocks.livelocks.rows import (
    _also as _also,
)
from distlocks.livelocks.rows import (
    _Context as _Context,
)
from distlocks.livelocks.rows import (
    _listing as _listing,
)
from distlocks.livelocks.rows import (
    _live as _live,
)
from distlocks.livelocks.rows import (
    _micros as _micros,
)
from distlocks.livelocks.rows import (
    _needs_details as _needs_details,
)
from distlocks.livelocks.rows import (
    _row as _row,
)
from distlocks.livelocks.rows import (
    _summary_info as _summary_info,
)
from distlocks.livelocks.rows import (
    _summary_row as _summary_row,
)
from distlocks.livelocks.selection import (
    _BASE_ORDER as _BASE_ORDER,
)
from distlocks.livelocks.selection import (
    _STATUS_RANK as _STATUS_RANK,
)
from distlocks.livelocks.selection import (
    SORTS,
    Selection,
    matches,
    select,
    status_counts,
)
from distlocks.livelocks.selection import (
    _base_sort as _base_sort,
)
from distlocks.livelocks.selection import (
    _count_rows as _count_rows,
)
from distlocks.livelocks.selection import (
    _holder_of as _holder_of,
)
from distlocks.livelocks.selection import (
    _matches as _matches,
)
from distlocks.livelocks.selection import (
    _select_rows as _select_rows,
)
from distlocks.livelocks.status import (
    _HOSTNAME as _HOSTNAME,
)
from distlocks.livelocks.status import (
    EXPIRING,
    EXPIRING_FRACTION,
    KEPT,
    KINDS,
    LOCK,
    OK,
    ORPHANED,
    PERMIT_KINDS,
    STATUSES,
    STUCK,
    LiveLock,
    check_ref,
    classify,
    describe_kind,
    format_seconds,
)
from distlocks.livelocks.status import (
    _jsonable as _jsonable,
)
from distlocks.livelocks.status import (
    _orphan_reason as _orphan_reason,
)
from distlocks.livelocks.status import (
    _pid_gone as _pid_gone,
)
from distlocks.livelocks.status import (
    _round as _round,
)

# The private names imported above (``_Context``, ``_summary_row``...) are re-exported
# for the tests that check the listing's internals, as they were before the split.
__all__ = [
    "DEFAULT_LIMIT",
    "EVICTION_WAIT",
    "EXPIRING",
    "EXPIRING_FRACTION",
    "KEPT",
    "KINDS",
    "LOCK",
    "MAX_READERS",
    "OK",
    "ORPHANED",
    "PERMIT_KINDS",
    "READ",
    "SEMAPHORE",
    "SORTS",
    "STATUSES",
    "STUCK",
    "WRITE",
    "BaseBackend",
    "ForceReleased",
    "LiveLock",
    "LockInfo",
    "Row",
    "Rows",
    "Selection",
    "Snapshot",
    "SnapshotCache",
    "Tally",
    "TokenChanged",
    "check_ref",
    "classify",
    "collect",
    "complete",
    "conf",
    "configured_aliases",
    "describe_error",
    "describe_kind",
    "force_release",
    "format_seconds",
    "get",
    "holder_details",
    "inspect",
    "logger",
    "matches",
    "select",
    "snapshots",
    "status_counts",
    "tally",
]
