"""The etcd backend: locks, semaphores and read-write locks on etcd v3 leases, through
its JSON gateway (no driver to install). See docs/backend-etcd.md.

One concern a module, each class of the backend built on the one below it::

    config          OPTIONS, LOCATION's endpoints and credentials, config problems, TLS
    protocol        what requests mean, free of I/O: transport steps, codecs, tokens
    http11          HTTP/1.1 on asyncio streams (the asyncio driver's connections)
    hub             one event loop's waiters sharing one watch stream
    transport       EtcdTransport: connections, the blocking and the asyncio driver
    gateway         EtcdGateway: requests as sans-I/O generators (members, retries,
                    auth, errors), transactions and leases
    watch           EtcdWatches: watch streams
    lock_acquire    EtcdLockAcquire: the lock recipe, acquire and wait
    lock_held       EtcdLockHeld: the lock recipe, release, extend, force release
    permit_rules    which permit requests hold (free of I/O)
    permit_acquire  EtcdPermitAcquire: semaphores and read-write locks, acquire and wait
    permit_held     EtcdPermitHeld: release, extend, eviction of permits
    listing         EtcdListing: inspect and list locks and permits
    backend         EtcdBackend: the class named in BACKEND

Only ``EtcdBackend`` is public; the few helpers re-exported here are the ones tests use.
"""

from __future__ import annotations

from distlocks.backends.etcd.backend import EtcdBackend
from distlocks.backends.etcd.protocol import (
    MAX_TOKEN,
    _b64,
    _prefix_end,
    holder_value,
    lease_seconds,
    token_of,
)

__all__ = [
    "MAX_TOKEN",
    "EtcdBackend",
    "_b64",
    "_prefix_end",
    "holder_value",
    "lease_seconds",
    "token_of",
]
