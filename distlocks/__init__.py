"""distlocks: distributed locks with fencing tokens for Django."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from distlocks.backends.base import BaseBackend
from distlocks.handler import backends
from distlocks.lease import AsyncLease, Lease
from distlocks.locks import AsyncLock, Lock, alock, lock, lock_many
from distlocks.primitives import (
    AsyncPermitLock,
    AsyncRWLock,
    PermitLock,
    RWLock,
    arwlock,
    asemaphore,
    rwlock,
    semaphore,
)

try:
    __version__ = version("distlocks")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "AsyncLease",
    "AsyncLock",
    "AsyncPermitLock",
    "AsyncRWLock",
    "Lease",
    "Lock",
    "PermitLock",
    "RWLock",
    "alock",
    "arwlock",
    "asemaphore",
    "get_backend",
    "lock",
    "lock_many",
    "rwlock",
    "semaphore",
]


def get_backend(alias: str = "default") -> BaseBackend:
    """The backend instance configured as ``alias`` in ``DISTLOCKS_BACKENDS``."""
    return backends[alias]
