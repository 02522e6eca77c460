"""Live locks across every configured backend, for the admin page, the command and metrics.

Whatever a backend's :meth:`~distlocks.backends.capabilities.Listing.iter_locks` yields
is listed, so a new backend shows up without changes here; a backend that does not
declare :class:`~distlocks.backends.capabilities.Listing` is named with the one answer
"cannot list its locks" (:attr:`Snapshot.unlisted`), never as an error. Each lock gets a
status:

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
from distlocks.livelocks import rows as _rows
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
from distlocks.livelocks.release import (
    EVICTION_WAIT,
    ForceReleased,
    TokenChanged,
    complete,
    force_release,
    inspect,
)
from distlocks.livelocks.rows import (
    Row,
    Rows,
)
from distlocks.livelocks.selection import (
    SORTS,
    Selection,
    matches,
    select,
    status_counts,
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

# The rows' internals that tests check directly (tests/test_admin_scale.py), reachable
# here as when this package was one module.
_Context = _rows._Context
_EPOCH = _rows._EPOCH
_MICROSECOND = _rows._MICROSECOND
_STATUS = _rows._STATUS
_live = _rows._live
_summary_info = _rows._summary_info
_summary_row = _rows._summary_row
