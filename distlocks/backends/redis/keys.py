"""The key layout of a lock name (see the package's docstring): :class:`Keys`,
and :class:`RedisKeys`, the backend's part that makes and caches them.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from distlocks.backends.base import BaseBackend
from distlocks.backends.capabilities import Listing, Permits, Waiting


class Keys(NamedTuple):
    """The keys of one lock (all share one hash tag, so one cluster slot)."""

    lock: str
    fence: str
    waiters: str
    queue: str
    signal: str
    wake_prefix: str


class RedisKeys(Listing, Waiting, Permits, BaseBackend):
    """The keys of a name under this backend's ``key_prefix``, all in one Redis
    Cluster slot (set by :class:`~distlocks.backends.redis.clients.RedisClients`)."""

    key_prefix: str
    _keys_cache: dict[str, Keys]

    def keys(self, name: str) -> tuple[str, str]:
        """The lock hash key and the fencing counter key of ``name``."""
        keys = self.all_keys(name)
        return keys.lock, keys.fence

    def all_keys(self, name: str) -> Keys:
        """Every key of ``name``, all in one Redis Cluster slot."""
        keys = self._keys_cache.get(name)
        if keys is None:
            if len(self._keys_cache) >= 4096:
                self._keys_cache.clear()
            keys = self._keys_cache[name] = self._make_keys(name)
        return keys

    def _make_keys(self, name: str) -> Keys:
        tag = name
        if "{" in name or "}" in name or name.startswith("#"):
            # Braces would break the hash tag: such a name is tagged with a hash of
            # itself, marked by "#". A plain name starting with "#" is hashed too, so
            # it can never be taken for (and share the keys of) a hashed one.
            tag = "#" + hashlib.sha256(name.encode()).hexdigest()[:32]
        base = f"{self.key_prefix}:{{{tag}}}"
        return Keys(
            lock=f"{base}:lock",
            fence=f"{base}:fence",
            waiters=f"{base}:waiters",
            queue=f"{base}:queue",
            signal=f"{base}:signal",
            wake_prefix=f"{base}:wake:",
        )
