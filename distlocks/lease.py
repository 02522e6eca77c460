"""A held lock: :class:`Lease`.

A lease is the holder's side of a lock. It knows, without asking the server,
until when it is certainly valid (a monotonic deadline taken *before* the
acquire request was sent, so it errs on the safe side), and it remembers loudly
when it has been lost: ``held()`` turns False, ``ensure_held()`` raises
:class:`~distlocks.exceptions.LockLost`, the ``lock_lost`` signal fires and the
``on_lost`` callback runs, exactly once.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from distlocks import signals
from distlocks.exceptions import LockLost
from distlocks.validation import validate_ttl

if TYPE_CHECKING:
    from distlocks.backends.base import BaseBackend

logger = logging.getLogger(__name__)

HELD = "held"
RELEASED = "released"
LOST = "lost"


class Lease:
    """One acquisition of one lock, by one owner."""

    def __init__(
        self,
        *,
        backend: BaseBackend,
        name: str,
        owner: str,
        fencing_token: int,
        ttl: float,
        started: float,
        remaining: float | None,
        on_lost: Callable[[Lease], object] | None = None,
    ) -> None:
        self._backend = backend
        #: The lock name.
        self.name = name
        #: The backend alias (a key of ``DISTLOCKS_BACKENDS``).
        self.backend = backend.alias
        #: Random id of this acquisition; release and extend check it on the server.
        self.owner = owner
        #: Strictly increasing per lock name; send it with every write.
        self.fencing_token = fencing_token
        #: Lease length in seconds (the last one asked for).
        self.ttl = ttl
        now = dt.datetime.now(dt.UTC)
        #: Wall-clock time of the acquisition (for display; deadlines use the monotonic clock).
        self.acquired_at = now
        #: Wall-clock end of the lease, or None where the backend has no expiry.
        self.expires_at = None if remaining is None else now + dt.timedelta(seconds=remaining)
        self.on_lost = on_lost
        self.renewals = 0
        self._valid_until = None if remaining is None else started + remaining
        self._state = HELD
        self._lost_reason = ""
        self._release_requested = False
        self._mutex = threading.RLock()

    def __repr__(self) -> str:
        return (
            f"<Lease {self.name!r} backend={self.backend!r} token={self.fencing_token} "
            f"state={self.state}>"
        )

    @property
    def state(self) -> str:
        """``"held"``, ``"released"`` or ``"lost"`` (local knowledge)."""
        self.held()
        return self._state

    @property
    def lost_reason(self) -> str:
        return self._lost_reason

    def remaining(self) -> float | None:
        """Seconds the lease is certainly still valid for, by the local monotonic clock."""
        if self._valid_until is None:
            return None
        return max(0.0, self._valid_until - time.monotonic())

    def held(self) -> bool:
        """True while the lease is known to be valid. Local knowledge only, no I/O."""
        if self._state != HELD:
            return False
        if self._valid_until is not None and time.monotonic() >= self._valid_until:
            self._mark_lost(f"its {self.ttl:g}s lease ran out without being renewed")
            return False
        return True

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` if the lease is known to be lost (or was released)."""
        if not self.held():
            if self._state == RELEASED:
                raise LockLost(self, "it was already released")
            raise LockLost(self, self._lost_reason)

    def extend(self, ttl: float | None = None) -> None:
        """Reset the lease to ``ttl`` seconds from now (default: the current ttl).

        Raises :class:`LockLost` if the server no longer has this lease.
        """
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        with self._mutex:
            self.ensure_held()
            started = time.monotonic()
            if not self._backend.extend(self.name, self.owner, ttl):
                self._mark_lost("the server no longer had it when it was extended")
                raise LockLost(self, self._lost_reason)
            self.ttl = ttl
            self.renewals += 1
            if self._backend.supports_expiry:
                self._valid_until = started + ttl
                self.expires_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=ttl)

    def release(self) -> bool:
        """Free the lock if this lease still holds it.

        Idempotent: returns True when this call freed the lock, False when the lease
        had already been released or lost (a loss found here is reported as lost).
        Raises :class:`~distlocks.exceptions.LockBackendUnavailable` if the server
        cannot be reached; the lease then ends by expiry.
        """
        with self._mutex:
            if self._state != HELD:
                return False
            self._release_requested = True
            freed = self._backend.release(self.name, self.owner)
            if not freed:
                self._mark_lost("the server no longer had it at release")
                return False
            self._state = RELEASED
        signals.lock_released.send(sender=Lease, lease=self)
        return True

    def _mark_lost(self, reason: str) -> None:
        """Record the loss once: log, signal, callback. Never raises."""
        with self._mutex:
            if self._state != HELD:
                return
            self._state = LOST
            self._lost_reason = reason
        logger.warning(
            "Lost lock %r on backend %r (fencing token %s): %s",
            self.name, self.backend, self.fencing_token, reason,
        )  # fmt: skip
        try:
            signals.lock_lost.send_robust(sender=Lease, lease=self, reason=reason)
            if self.on_lost is not None:
                self.on_lost(self)
        except Exception:
            logger.exception("on_lost callback for lock %r raised", self.name)
