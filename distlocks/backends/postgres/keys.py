"""Advisory-lock keys: a lock name to the signed 64-bit key the server locks.

SHA-256 of the prefix and the name, never crc32 or ``hashtext``, which collide.
"""

from __future__ import annotations

import functools
import hashlib
import struct

from distlocks.backends.base import SEMAPHORE


@functools.lru_cache(maxsize=4096)
def lock_key(prefix: str, name: str) -> int:
    """The signed 64-bit advisory-lock key of ``name`` under ``prefix`` (SHA-256;
    cached: a name is usually locked again, and each acquire needs two keys)."""
    digest = hashlib.sha256(f"{prefix}\x00{name}".encode()).digest()
    return int(struct.unpack(">q", digest[:8])[0])


@functools.lru_cache(maxsize=1024)
def slot_keys(prefix: str, name: str, limit: int) -> list[int]:
    """The advisory-lock keys of a semaphore's slots (cached: waiters poll with them)."""
    return [lock_key(prefix, f"{name}\x00{SEMAPHORE}\x00{slot}") for slot in range(limit)]


def key_parts(key: int) -> tuple[int, int]:
    """``(classid, objid)`` as ``pg_locks`` shows a bigint key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF
