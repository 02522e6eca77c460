"""The grants' sweep of the Redis listing index (scripts.INDEX_SWEEP_EVERY,
INDEX_SWEEP_COUNT): over one pass it drops every entry whose expiry is more than
INDEX_PRUNE_AFTER_MS past, and nothing else: not a live lease's entry (held, extended,
kept), not one not yet past the margin, not an entry without an expiry, not the
index's epoch field. Entries of long-gone leases are written into the index as a lease
that expired would have left them (expiry in the past), so no test waits for a clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import (
    INDEX_PRUNE_AFTER_MS,
    INDEX_SWEEP_COUNT,
    INDEX_SWEEP_EVERY,
)

HOLDER = Holder("host", 1, "thread")


@pytest.fixture(scope="module")
def backend() -> Iterator[RedisBackend]:
    prefix = f"index-sweep-{uuid.uuid4().hex[:8]}"
    backend = RedisBackend(
        "sweep", {"LOCATION": django_settings.REDIS_URL, "OPTIONS": {"key_prefix": prefix}}
    )
    assert backend.listing_index
    assert list(backend.iter_lock_summaries()) == []  # builds the index: its epoch field
    assert backend.client.hexists(backend.index_key, backend.INDEX_EPOCH_FIELD)
    yield backend
    keys = list(backend.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        backend.client.delete(*keys)
    backend.close()


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def entry(owner: str, expires: str) -> str:
    """An index entry as the scripts write it (see scripts._ENTRY)."""
    return "\0".join([owner, "7", "host", "1", "thread", "0", expires, "1000", "0", "{}"])


#: What each written entry is: gone long ago (dropped), not past the margin yet, without
#: an expiry, or the whole entry '' (a lock whose fields hold a NUL): the last three stay.
STALE = st.lists(st.sampled_from(["long gone", "not yet due", "no expiry", "blank"]), max_size=60)
#: Live leases: held, held and extended, held and kept (lock_at_least_for).
LIVE = st.lists(st.sampled_from(["held", "extended", "kept"]), max_size=12)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stale=STALE, live=LIVE)
def test_one_pass_drops_exactly_the_entries_expired_past_the_margin(
    backend: RedisBackend, stale: list[str], live: list[str]
) -> None:
    client = backend.client
    index = backend.index_key
    # The index of this example: its epoch field only.
    epoch = backend.INDEX_EPOCH_FIELD.encode()
    client.hdel(index, *(f for f in client.hkeys(index) if f != epoch), "-")
    run = uuid.uuid4().hex[:8]
    held = []
    for i, kind in enumerate(live):
        name, owner = f"{run}:live:{i}", f"owner-{i}"
        assert backend.acquire(name, owner, 600, HOLDER).acquired
        if kind == "extended":
            assert backend.extend(name, owner, 300)
        elif kind == "kept":
            assert backend.keep(name, owner, 300)
        held.append(name)
    now = server_ms(client)
    expected = set(held) | {backend.INDEX_EPOCH_FIELD}
    for i, kind in enumerate(stale):
        name = f"{run}:stale:{i}"
        if kind == "long gone":
            value = entry("o", str(now - INDEX_PRUNE_AFTER_MS - 60_000))
        elif kind == "not yet due":
            # Due a minute from now (the margin included): room for the time the test takes.
            value = entry("o", str(now - INDEX_PRUNE_AFTER_MS + 60_000))
            expected.add(name)
        elif kind == "no expiry":
            value = entry("o", "")
            expected.add(name)
        else:
            value = ""
            expected.add(name)
        client.hset(index, name, value)
    # Released cycles until the sweep, begun at the start of the index (its cursor
    # deleted here, the entries written), has come back to the start: one whole pass.
    # About one grant in INDEX_SWEEP_EVERY sweeps (which ones follows the clock); the
    # limit is far above.
    limit = 50 * INDEX_SWEEP_EVERY * (client.hlen(index) // INDEX_SWEEP_COUNT + 2)
    client.delete(f"{index}:sweep")
    cycles = 0
    while client.get(f"{index}:sweep") != b"0":
        assert cycles < limit, f"no whole pass of the sweep in {cycles} grants"
        name = f"{run}:cycle:{cycles}"
        assert backend.acquire(name, "c", 30, HOLDER).acquired
        assert backend.release(name, "c")
        cycles += 1
    fields = {field.decode() for field in client.hkeys(index)}
    assert fields == expected
    for i, name in enumerate(held):  # still held
        assert backend.release(name, f"owner-{i}")
