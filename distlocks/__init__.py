"""distlocks: distributed locks with fencing tokens for Django."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from distlocks.backends.base import BaseBackend
from distlocks.handler import backends
from distlocks.lease import AsyncLease, Lease
from distlocks.locks import AsyncLock, Lock, alock, lock, lock_many

try:
    __version__ = version("distlocks")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "AsyncLease",
    "AsyncLock",
    "Lease",
    "Lock",
    "alock",
    "get_backend",
    "lock",
    "lock_many",
]


def get_backend(alias: str = "default") -> BaseBackend:
    """The backend instance configured as ``alias`` in ``DISTLOCKS_BACKENDS``."""
    return backends[alias]
