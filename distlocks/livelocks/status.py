"""The status of a live lock, and :class:`LiveLock`, one listed lock with its status.

The rules of the statuses are in the docstring of :mod:`distlocks.livelocks`.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distlocks.backends.base import READ, SEMAPHORE, WRITE, LockInfo
from distlocks.conf import conf

OK = "ok"
EXPIRING = "expiring"
STUCK = "stuck"
ORPHANED = "orphaned"
KEPT = "kept"
#: Most severe first: the order of the status sort.
STATUSES = (ORPHANED, STUCK, EXPIRING, KEPT, OK)
#: Less than this fraction of the ttl left: an auto-renewed lease would have been extended.
EXPIRING_FRACTION = 1 / 3


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
