"""The class named in ``BACKEND``: :class:`RedlockBackend`, the Redlock modules of this
package put together (see the package's docstring for which holds what)."""

from __future__ import annotations

from typing import ClassVar

from distlocks.backends.redlock.attempts import RedlockAttempts
from distlocks.backends.redlock.held import RedlockHeld
from distlocks.backends.redlock.listing import RedlockListing


class RedlockBackend(RedlockAttempts, RedlockHeld, RedlockListing):
    """Locks held by a majority of N independent Redis masters (``LOCATION``: their URLs).

    ``OPTIONS``: those of :class:`~distlocks.backends.redis.RedisBackend` that apply to
    each master (``socket_timeout``, ``socket_connect_timeout``, ``key_prefix``,
    ``client_kwargs``), and ``drift_factor`` and ``drift_margin`` (the clock-drift
    allowance taken off every lease).

    Each contract method comes from one of the classes below it, all on the masters'
    rounds (:mod:`.masters`): acquire and wait (:mod:`.attempts`), release, renewal,
    force release and the fencing counter (:mod:`.held`), inspect and listing
    (:mod:`.listing`); the settings' checks from :mod:`.config`.
    """

    wakes_on_release = True
    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION"})
