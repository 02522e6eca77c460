"""Redlock backend: a lock is held when a majority of N independent Redis masters hold it.

Each master is driven by a :class:`~distlocks.backends.redis.RedisBackend` of its
own, on the single-node key layout: release, force release and leaving the wait
queue are the single-node Lua scripts; acquire wraps the single-node one, and this
package adds three of its own (confirm a grant, give back, extend). Around them, the
quorum:

* every request goes to all masters at once (one thread pool per master, so a
  hung master only backs up its own pool), and each round waits at most the
  socket timeout for answers;
* an acquisition needs ``N // 2 + 1`` grants, and its validity is what is left
  of the ttl after the round trips and a clock-drift allowance; a failed attempt
  gives back every grant it got, so no master keeps a partial lock;
* the attempts of one waiting acquisition share its owner, so every request also
  carries the attempt's id, and each entry records the newest step of its owner
  that made it its own: an attempt, or the lease once renewed. A request of an
  older step (a give-back, confirmation or grant that arrives late) changes
  nothing, so it cannot free or shorten what a newer attempt or the lease counts on;
* release and renewal succeed when a quorum confirms them, and report the lease
  gone only when so many masters deny it that no quorum can hold it; when the
  masters that did not answer decide it, they raise LockBackendUnavailable;
* fencing tokens: each master mints ``max(last + 1, its clock in µs)`` as the
  single-node backend does; the grant takes the largest token of its quorum and,
  in a second short round, raises the counter of every granting master to that
  token, while its own entry is still there. Any later
  quorum shares a master with this one, and that master can only grant after
  this lease ended there, so it mints above the token. See ``docs/backends.md``.

Redlock survives the crash of a minority of masters. It does not survive a
client paused past its lease or a master clock that jumps: fencing tokens, checked
by the storage, are still what keeps those cases safe.

One concern a module, each class of the backend built on the one below it::

    scripts     the Lua run on each master, free of I/O
    quorum      the arithmetic: a majority, milliseconds, what a round brought back
    config      LOCATION's masters and OPTIONS, their problems, the even-masters check
    masters     RedlockMasters: one single-node backend and thread pool per master,
                rounds to all of them, which are down, errors naming who answered
    attempts    RedlockAttempts: acquisition attempts (ids, grants, confirmation,
                give-back) and waiting for a release
    held        RedlockHeld: release, renewal, force release, the fencing counter
    listing     RedlockListing: inspect and list locks as the quorum sees them
    backend     RedlockBackend: the class named in BACKEND

Only ``RedlockBackend`` is public; the other names re-exported here are the ones the
single module had, which tests and checks take from it.
"""

from __future__ import annotations

from distlocks.backends.redlock.attempts import RETRY_JITTER
from distlocks.backends.redlock.backend import RedlockBackend
from distlocks.backends.redlock.config import (
    DEFAULT_DRIFT_FACTOR,
    DEFAULT_DRIFT_MARGIN,
    EVEN_MASTERS,
    MIN_MASTERS,
    W_EVEN_MASTERS,
    describe_url,
)
from distlocks.backends.redlock.masters import THREADS_PER_MASTER
from distlocks.backends.redlock.quorum import quorum
from distlocks.backends.redlock.scripts import (
    _SCRIPTS,
    ACQUIRE,
    CONFIRM,
    EXTEND,
    EXTEND_MANY,
    GIVE_BACK,
)

__all__ = [
    "ACQUIRE",
    "CONFIRM",
    "DEFAULT_DRIFT_FACTOR",
    "DEFAULT_DRIFT_MARGIN",
    "EVEN_MASTERS",
    "EXTEND",
    "EXTEND_MANY",
    "GIVE_BACK",
    "MIN_MASTERS",
    "RETRY_JITTER",
    "THREADS_PER_MASTER",
    "W_EVEN_MASTERS",
    "_SCRIPTS",
    "RedlockBackend",
    "describe_url",
    "quorum",
]
