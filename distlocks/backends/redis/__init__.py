"""Redis backend: one lock = one hash with an expiry, taken by one Lua script.

One server (``redis://``, ``rediss://``, ``unix://`` or a django-redis cache), a
Redis Cluster (``redis+cluster://host:port,host:port``) or a primary found through
Sentinel (``redis+sentinel://host:port,host:port/<service>/<db>``): the scripts and
the key layout are the same for all three.

Keys of the lock ``name`` (``prefix`` is ``OPTIONS["key_prefix"]``, default
``DISTLOCKS_KEY_PREFIX``)::

    {prefix}:{<name>}:lock    hash: owner, token, name, host, pid, thread,
                              acquired_at (server ms), ttl (ms), renewals, extra
    {prefix}:{<name>}:fence   the per-name fencing counter (expires once no lease on
                              the name is live and the clock has passed it)

The braces are a Redis Cluster hash tag: every key of a lock (see ``Keys``) lives
in one slot, so every script (:mod:`.scripts`) touches a single slot. A name that itself
contains a brace, or starts with ``#``, is tagged with ``#`` and a hash of the name
instead (so no plain name can be read as such a tag). The scripts get every
key in KEYS (a release's tombstone, ``<base>:released:<owner>``, too) except the fair
waiters' own wake-up lists, ``<base>:wake:<owner>``: the one to push to is the head of
the queue, known only inside the script. They are built from the wake prefix (an
argument), which carries the same tag, so they are in the same slot as the declared
keys; a cluster node runs a script that touches undeclared keys of the slot it serves
(the cluster tests check every key each operation touches). The listing index's sweep
state, ``<index>:sweep``, is built from the index key the same way (no index on a
cluster).

Every operation that must be atomic (acquire, release, extend, force release)
is one ``EVALSHA``: one round trip, one server-side step.

One concern a module, each class of the backend built on the one below it::

    scripts         the locks' Lua scripts and the fencing counter's grace (no I/O)
    permit_scripts  the semaphores' and read-write locks' Lua scripts (no I/O)
    config          LOCATION (one server, cluster, Sentinel) and OPTIONS checks
    keys            Keys, the key layout of a name; RedisKeys, the backend's keys
    clients         RedisClients: the redis-py clients (server, cluster, Sentinel,
                    one asyncio client per event loop) and their timeouts
    calls           RedisCalls: running a script (pinned connections, direct
                    EVALSHA, asyncio), driver errors as LockError
    lock            RedisLocks: the lock recipe (acquire, wait, release, extend,
                    keep, force release, fair queue, fencing counter)
    permits         RedisPermits: semaphores and read-write locks
    listing         RedisListing: inspect and list locks, the listing index
    backend         RedisBackend: the class named in BACKEND

Only ``RedisBackend`` is public; the scripts and helpers re-exported here are the
ones the Redlock backend, tests and benchmarks import.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

try:
    import redis  # noqa: F401 - imported first so that its absence says what to install
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.redis.RedisBackend needs redis-py: pip install 'distlocks[redis]'."
    ) from exc

from distlocks.backends.redis.backend import RedisBackend
from distlocks.backends.redis.config import Location, parse_location
from distlocks.backends.redis.keys import Keys
from distlocks.backends.redis.permits import RedisPermits
from distlocks.backends.redis.scripts import (
    _ATTEMPTS,
    _KINDS,
    _NEXT_TOKEN,
    ACQUIRE,
    EXTEND,
    EXTEND_MANY,
    FENCE_GRACE_MS,
    FORCE_RELEASE,
    GIVE_BACK,
    INDEX,
    INDEX_BEGIN,
    INDEX_DONE,
    INSPECT,
    KEEP,
    LEAVE,
    LIST,
    RELEASE,
    SCRIPTS,
)

__all__ = [
    "ACQUIRE",
    "EXTEND",
    "EXTEND_MANY",
    "FENCE_GRACE_MS",
    "FORCE_RELEASE",
    "GIVE_BACK",
    "INDEX",
    "INDEX_BEGIN",
    "INDEX_DONE",
    "INSPECT",
    "KEEP",
    "LEAVE",
    "LIST",
    "RELEASE",
    "SCRIPTS",
    "_ATTEMPTS",
    "_KINDS",
    "_NEXT_TOKEN",
    "Keys",
    "Location",
    "RedisBackend",
    "RedisPermits",
    "parse_location",
]
