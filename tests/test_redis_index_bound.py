"""The Redis listing index stays bounded when leases expire unreleased and nobody
lists them: each grant drops the entries of leases that expired (their own keys are
gone), so the index holds the live leases and at most the few expired since the last
grants, not every lease ever taken. Counted in entries, not timed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.conf import settings as django_settings

from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from tests.waiting import wait_for

HOLDER = Holder("host", 1, "thread")
#: Leases taken, each for 1 ms, never released, never listed.
EXPIRED = 20_000
#: Leases held throughout (one every 80 expired ones), then after the rest.
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


def _chunks(items: list[bytes], size: int) -> Iterator[list[bytes]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def test_twenty_thousand_expired_leases_leave_no_index_entries(backend: RedisBackend) -> None:
    client = backend.client
    held = [f"held:{i}" for i in range(HELD)]
    # The acquire script, as the backend runs it, pipelined (1,000 a round trip).
    assert backend.acquire(held[0], "owner", 600, HOLDER).acquired
    sha = backend._scripts["acquire"].sha
    pipe = client.pipeline(transaction=False)
    for i in range(EXPIRED):
        keys, args = backend._indexed_acquire_call(f"short:{i}", "o", 0.001, HOLDER, 0, False)
        pipe.evalsha(sha, len(keys), *keys, *args)
        if i % 80 == 0 and i // 80 + 1 < HELD // 2:
            keys, args = backend._indexed_acquire_call(
                held[i // 80 + 1], "owner", 600, HOLDER, 0, False
            )
            pipe.evalsha(sha, len(keys), *keys, *args)
        if i % 1000 == 999:
            assert all(granted for granted, _, _ in pipe.execute())
    pipe.execute()
    last = backend.all_keys(f"short:{EXPIRED - 1}").lock
    wait_for(lambda: not client.exists(last), what="the last short lease to expire")
    # The grants after them drop the rest of the expired entries, INDEX_PRUNE each.
    for name in held[HELD // 2 :]:
        assert backend.acquire(name, "owner", 600, HOLDER).acquired
    entries = client.hlen(backend.index_key)
    due = client.zcard(f"{backend.index_key}:expiry")
    assert (entries, due) == (HELD, HELD), (
        f"{entries} index entries (and {due} in its expiry set) for {HELD} live leases, "
        f"after {EXPIRED} leases expired unlisted"
    )
    # Nothing held was dropped: the listing shows exactly the live leases.
    listed = sorted(item[0] for item in backend.iter_lock_summaries())
    assert listed == sorted(held)
