"""One live lock read from its server (:func:`inspect`, :func:`complete`) and
forced free (:func:`force_release`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distlocks import signals
from distlocks.backends.base import READ, WRITE, BaseBackend, LockInfo
from distlocks.backends.capabilities import Permits, require
from distlocks.livelocks.collection import get, snapshots
from distlocks.livelocks.status import LOCK, LiveLock, check_ref, classify, describe_kind
from distlocks.redaction import escape_control

# The package's one logger, as before the split: its name is what logging settings
# and operators' filters know.
logger = logging.getLogger("distlocks.livelocks")


def _holder_info(backend: BaseBackend, name: str, kind: str, owner: str) -> LockInfo | None:
    """What the server shows of ``name`` (a lock), or of ``owner``'s permit of ``kind``."""
    if kind == LOCK:
        return backend.inspect(name)
    for info in require(backend, Permits, kind).permit_holders(kind, name):
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
            counter = (
                require(backend, Permits, kind).permit_counter(name)
                if kind in (READ, WRITE)
                else None
            )
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
