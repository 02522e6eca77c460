"""The Redis listing index stays bounded when leases expire unreleased and nobody
lists them: the grants sweep the index (about one grant in INDEX_SWEEP_EVERY reads about
INDEX_SWEEP_COUNT entries) and drop the entries of leases that expired (their own keys
are gone), so the index holds the live leases and at most about as many expired ones,
not every lease ever taken. Counted in entries and grants, not timed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings

from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import (
    INDEX_PRUNE_AFTER_MS,
    INDEX_SWEEP_COUNT,
    INDEX_SWEEP_EVERY,
)
from tests.waiting import wait_for

HOLDER = Holder("host", 1, "thread")
#: Leases taken, each for 1 ms, never released, never listed.
EXPIRED = 20_000
#: Leases held throughout (one every 80 expired ones, then after the rest).
HELD = 250


@pytest.fixture
def backend() -> Iterator[RedisBackend]:
    prefix = f"index-bound-{uuid.uuid4().hex[:8]}"
    backend = RedisBackend(
        "bound", {"LOCATION": django_settings.REDIS_URL, "OPTIONS": {"key_prefix": prefix}}
    )
    assert backend.listing_index
    yield backend
    client = backend.client
    for keys in _chunks(list(client.scan_iter(match=f"{prefix}:*", count=5000)), 5000):
        client.delete(*keys)
    backend.close()


def granted(reply: Any) -> bool:
    """An acquire's reply granted, or a release's done."""
    return reply == 1 if isinstance(reply, int) else reply[0] == 1


def server_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def _chunks(items: list[bytes], size: int) -> Iterator[list[bytes]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def test_twenty_thousand_expired_leases_leave_no_index_entries(backend: RedisBackend) -> None:
    client = backend.client
    held = [f"held:{i}" for i in range(HELD)]
    # The backend's own scripts and calls, pipelined (1,000 a round trip).
    assert backend.acquire(held[0], "owner", 600, HOLDER).acquired
    assert backend.release(f"warm:{uuid.uuid4().hex}", "o") is False  # loads the script
    acquire, release = backend._scripts["acquire"].sha, backend._scripts["release"].sha
    pipe = client.pipeline(transaction=False)

    def grant(name: str, ttl: float) -> None:
        keys, args = backend._indexed_acquire_call(name, "owner", ttl, HOLDER, 0, False)
        pipe.evalsha(acquire, len(keys), *keys, *args)

    for i in range(EXPIRED):
        grant(f"short:{i}", 0.001)
        if i % 80 == 0 and i // 80 + 1 < HELD // 2:
            grant(held[i // 80 + 1], 600)
        if i % 1000 == 999:
            assert all(granted(reply) for reply in pipe.execute())
    pipe.execute()
    # Entries are dropped once their expiry is INDEX_PRUNE_AFTER_MS past: wait for the
    # server's clock to get there for the last short lease (1 ms after its grant).
    last_ms = server_ms(client) + 1
    wait_for(
        lambda: server_ms(client) > last_ms + INDEX_PRUNE_AFTER_MS,
        limit=30,
        what="the server clock to pass the last short lease's expiry and the margin",
    )
    # Locks taken and released since, until the sweep dropped every expired entry: one
    # pass over the index reads about INDEX_SWEEP_COUNT entries per INDEX_SWEEP_EVERY
    # grants, so it takes about EXPIRED * EVERY / COUNT grants (a sorted set of expiries
    # dropped 4 per grant: 5,000 grants).
    one_pass = (EXPIRED + HELD) * INDEX_SWEEP_EVERY // INDEX_SWEEP_COUNT
    grants = 0
    while client.hlen(backend.index_key) > HELD // 2 and grants < 3 * one_pass:
        for _ in range(500):
            name = f"later:{grants}"
            grant(name, 30)
            keys, args = backend._indexed_release_call(name, "owner")
            pipe.evalsha(release, len(keys), *keys, *args)
            grants += 1
        assert all(granted(reply) for reply in pipe.execute())
    for name in held[HELD // 2 :]:
        grant(name, 600)
    pipe.execute()
    entries = client.hlen(backend.index_key)
    assert entries == HELD, (
        f"{entries} index entries for {HELD} live leases, after {EXPIRED} leases expired "
        f"unlisted and {grants} later grants"
    )
    # About one pass, with room for the sweep's reads falling short of COUNT (it reads
    # whole buckets of the hash, and the hash shrinks as entries go).
    assert grants <= 2 * one_pass, f"{grants} grants to sweep {EXPIRED} expired entries"
    # Nothing held was dropped: the listing shows exactly the live leases.
    listed = sorted(item[0] for item in backend.iter_lock_summaries())
    assert listed == sorted(held)
