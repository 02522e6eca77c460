"""The ZooKeeper backend: the classic lock recipe, fenced by the fence node's version
(kazoo).

Layout, under ``OPTIONS["prefix"]`` (default ``/distlocks``) below the chroot of
``LOCATION``::

    <prefix>/locks/n<quoted name>                 persistent: the fence node
    <prefix>/locks/n<quoted name>/c-<owner>-<seq> ephemeral sequential: one contender
    <prefix>/semaphores/n<quoted name>/permit-<owner>-<seq>    one permit request
    <prefix>/rwlocks/n<quoted name>                            the write fence node
    <prefix>/rwlocks/n<quoted name>/read-<owner>-<seq>         one read request
    <prefix>/rwlocks/n<quoted name>/write-<owner>-<seq>        one write request

* acquire lists the contenders, then is one multi-op: create this caller's contender
  node and write the fence node at the version listed (so no contender queued in
  between). The fence node's new version makes the fencing token, stored in the
  contender's data: versions only grow, one per write, across restarts and leader
  changes, and never jump (zxids jump by 2**32 at each election). The token is that
  version shifted per name to start at the server's clock (microseconds) at the name's
  first use (:func:`token_of`), so tokens stay above the clock floor the other
  backends keep, and above the old ones after the loss of all data.
* the contender with the lowest sequence number holds the lock; the others wait,
  each watching only the contender just before it (no herd, first come first served).
* release deletes the caller's own node; a waiter that gives up deletes its node too.
* force release is one multi-op deleting the holder's node (only if its token is the
  one given) and writing the fence node, so the counter moves past the victim.

Semaphores and read-write locks queue their requests the same way, each holding by
the rule of its kind over the nodes ahead of it and watching only the nodes that
decide it (see :func:`_blockers`); a write request is one multi-op with a write of
the read-write lock's fence node at the version listed, and its token comes from that
version as above.

The nodes are ephemeral: ZooKeeper deletes them when the client's session ends. A
lock therefore lives as long as the holder's session, not for ``ttl``; ``ttl`` is the
local lease and renewal period (see docs/backend-zookeeper.md).

One concern a module, each class of the backend built on the one below it::

    nodes       the layout, free of I/O: node names, queue order, which nodes decide
                a request, the fencing token of a zxid
    config      OPTIONS, LOCATION's problems; ZooKeeperConfig: settings and state
    session     ZooKeeperSession: the kazoo client, the granted session timeout,
                connection states, errors translated
    outages     ZooKeeperOutages: acquires through an outage, background deletes
    lock        ZooKeeperLock: the lock recipe
    permits     ZooKeeperPermits: semaphores and read-write locks
    listing     ZooKeeperListing: inspect and list locks and permits
    backend     ZooKeeperBackend: the class named in BACKEND

Only ``ZooKeeperBackend`` is public; the few helpers re-exported here are the ones
tests use.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

try:
    import kazoo  # noqa: F401 - imported first so that its absence says what to install
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.zookeeper.ZooKeeperBackend needs kazoo: "
        "pip install 'distlocks[zookeeper]'."
    ) from exc

from distlocks.backends.zookeeper.backend import ZooKeeperBackend
from distlocks.backends.zookeeper.config import DEFAULTS
from distlocks.backends.zookeeper.nodes import (
    _permit_kind,
    _permit_nodes,
    _permit_owner,
    token_of,
)

__all__ = [
    "DEFAULTS",
    "ZooKeeperBackend",
    "_permit_kind",
    "_permit_nodes",
    "_permit_owner",
    "token_of",
]
