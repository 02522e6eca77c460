"""The exceptions distlocks raises, all under :class:`LockError`.

Driver errors (redis-py, psycopg) never escape raw: they are wrapped where they
occur and chained as ``__cause__``, so ``except LockError`` is enough.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distlocks.lease import Lease


class LockError(Exception):
    """Base class of every distlocks error.

    Its message never carries a credential: text arguments pass through
    :func:`distlocks.redaction.redact` (a driver's error may quote a URL).
    """

    def __init__(self, *args: Any) -> None:
        from distlocks.redaction import redact, redact_handled

        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))
        # Made while a driver's error is handled, it is raised from that error, whose
        # message every traceback quotes: that one is cleaned too.
        redact_handled()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its message and attributes, without calling __init__ again, so
        # the error keeps its type through a Celery result or a process pool. An
        # attribute that cannot travel (a lease) arrives as None.
        state = {key: _portable(value) for key, value in self.__dict__.items()}
        return (_rebuild, (type(self), self.args), state)


def _rebuild(cls: type[LockError], args: tuple[Any, ...]) -> LockError:
    error = cls.__new__(cls)
    error.args = args
    return error


def _portable(value: Any) -> Any:
    try:
        pickle.dumps(value)
    except Exception:
        return None
    return value


class LockNotAcquired(LockError):
    """The lock was held by someone else until the timeout ran out."""

    def __init__(self, name: str, backend: str, timeout: float | None) -> None:
        self.name = name
        self.backend = backend
        self.timeout = timeout
        if timeout == 0:
            detail = "it is held by another owner (timeout=0: tried once)"
        else:
            detail = f"it was still held by another owner after waiting {timeout:g}s"
        super().__init__(f"Could not acquire lock {name!r} on backend {backend!r}: {detail}.")


class LockLost(LockError):
    """The lease ended before its holder released it (expired, deleted, or force-released)."""

    def __init__(self, lease: Lease | str | None = None, reason: str = "") -> None:
        if isinstance(lease, str):
            # Rebuilt from its message alone (as Celery's JSON result backend does).
            self.lease, self.reason = None, reason
            super().__init__(lease)
            return
        self.lease = lease
        self.reason = reason
        if lease is not None:
            msg = (
                f"Lock {lease.name!r} on backend {lease.backend!r} "
                f"(fencing token {lease.fencing_token}) was lost"
            )
        else:
            msg = "The lock was lost"
        super().__init__(f"{msg}: {reason}" if reason else f"{msg}.")


class StaleFencingToken(LockError):
    """A write carried a fencing token lower than one the storage already accepted."""

    def __init__(
        self,
        message: str = "",
        *,
        model: Any = None,
        pk: Any = None,
        offered: int | None = None,
        stored: int | None = None,
    ) -> None:
        self.model = model
        self.pk = pk
        self.offered = offered
        self.stored = stored
        super().__init__(message or f"Stale fencing token {offered} (stored {stored}).")


class FencedRowDeleted(StaleFencingToken):
    """A fenced save of an object loaded from the database found its row gone: another
    holder deleted it. Nothing is written (the row is not inserted again)."""


class FencingTokenRequired(LockError):
    """A fenced write was attempted without a fencing token (and outside ``unfenced()``)."""


class LockBackendUnavailable(LockError):
    """The lock server could not be reached, or did not answer in time."""

    def __init__(self, backend: str, message: str) -> None:
        self.backend = backend
        super().__init__(f"Lock backend {backend!r} is unavailable: {message}")
