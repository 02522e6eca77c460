"""Live-lock metrics at a scale past the listing's limit, with bounded scrape cost.

A scrape used to read the page's listing: capped at 100,000 locks (so 120,000 live
locks read as 100,000, and the stuck, orphaned and oldest numbers came from the first
100,000 only), with every lock held in memory (about 0.9 KiB each) and HSCAN calls of
10,000 fields that blocked Redis for 10-35 ms each. Now a scrape counts the locks as
the listing streams by (``livelocks.tally``): exact at any size, nothing kept, and
the server read in chunks of at most ``INDEX_CHUNK`` fields.
"""

from __future__ import annotations

import os
import socket
import tracemalloc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings
from prometheus_client import CollectorRegistry

from distlocks import get_backend, livelocks
from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.testing.servers import RedisServer

LOCKS = 120_000
#: Locks of a holder process that no longer exists (listed as orphaned).
ORPHANS = 3
GONE_PID = 2**31 - 7
#: How long ago the one stuck lock was taken.
OLD_S = 10 * 86400
#: A scrape of LOCKS locks may use this much memory at its peak: rows kept for every
#: lock would need more than twice as much (the page's listing of 100,000 peaks
#: near 47 MiB); the names remembered for HSCAN's repeats, about 100 bytes each, less.
PEAK_LIMIT = 20 * 2**20


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    from distlocks import metrics

    metrics.uninstall()
    fresh = CollectorRegistry()
    metrics.install(fresh)
    yield fresh
    metrics.uninstall()


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisBackend]:
    """LOCKS live locks on a Redis server of this module's own, the only backend
    (made once: the tests only read them)."""
    server = RedisServer(tmp_path_factory.mktemp("redis-many")).start()
    config = {
        "big": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": server.url,
            "OPTIONS": {"socket_timeout": 30},
        }
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        yield _fill()
    server.stop()


def _fill() -> RedisBackend:
    backend = get_backend("big")
    assert isinstance(backend, RedisBackend)
    here = Holder(host=socket.gethostname(), pid=os.getpid(), thread="t", extra={})
    gone = Holder(host=socket.gethostname(), pid=GONE_PID, thread="t", extra={})
    livelocks.collect(["big"])  # builds the (empty) index: the locks below keep it
    assert backend.acquire("warm", "warm", 3600, here).acquired  # loads the script
    sha = backend._scripts["acquire"].sha
    for start in range(1, LOCKS, 5000):
        pipe = backend.client.pipeline(transaction=False)
        for i in range(start, min(start + 5000, LOCKS)):
            keys, args = backend._indexed_acquire_call(
                f"n{i:06d}", uuid.uuid4().hex, 3600, gone if i <= ORPHANS else here, 0.0, False
            )
            pipe.evalsha(sha, len(keys), *keys, *args)
        assert all(reply[0] == 1 for reply in pipe.execute())
    # One lock taken long ago (a holder stuck in its work): its hash says so, and a
    # check of its index entry against the hash copies that into the entry (the index
    # is otherwise whole: a rebuild would walk all 120,000 locks again, 4 s or more).
    seconds, _ = backend.client.time()
    backend.client.hset(backend.all_keys("n099999").lock, "acquired_at", (seconds - OLD_S) * 1000)
    assert b"n099999" in backend._settle(["n099999"])  # held: its entry rewritten
    return backend


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[Any]], float]:
    """Every sample of one scrape, by name and labels (registry.get_sample_value
    scrapes anew at each call: a count of every lock each time)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def value(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_live_lock_metrics_are_exact_past_the_listing_limit(
    many: RedisBackend, registry: CollectorRegistry
) -> None:
    assert LOCKS > livelocks.DEFAULT_LIMIT
    samples = scrape(registry)
    statuses = {
        s: value(samples, "distlocks_live_locks", backend="big", status=s)
        for s in livelocks.STATUSES
    }
    assert sum(statuses.values()) == LOCKS
    assert statuses[livelocks.ORPHANED] == ORPHANS
    assert statuses[livelocks.STUCK] == 1
    assert value(samples, "distlocks_backend_up", backend="big") == 1
    assert value(samples, "distlocks_oldest_lock_age_seconds", backend="big") >= OLD_S - 60


def test_a_scrape_keeps_no_rows_and_reads_in_small_chunks(many: RedisBackend) -> None:
    """Memory: the peak of a count of every lock stays far below what rows of them
    would take. Server time: every command the count sends (as the server's SLOWLOG
    records them, each with its arguments) reads at most INDEX_CHUNK index fields or
    LIST_BATCH locks, so each call's server time is bounded whatever the number of
    locks (the time itself is measured, not asserted: see docs/operations.md)."""
    client = many.client
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 100_000)
    client.slowlog_reset()
    tracemalloc.start()
    try:
        counted = livelocks.tally(["big"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        log = client.slowlog_get(100_000)
        client.config_set("slowlog-log-slower-than", 10_000)
    assert counted.seen["big"] == LOCKS and not counted.errors and not counted.notes
    assert counted.counts["big"][livelocks.OK] == LOCKS - ORPHANS - 1
    assert peak < PEAK_LIMIT, f"peak {peak / 2**20:.1f} MiB"
    commands = [[_text(arg) for arg in entry["command"].split()] for entry in log]
    scans = [c for c in commands if c[0].upper() == "HSCAN"]
    assert len(scans) >= LOCKS // many.INDEX_CHUNK
    for command in scans:
        assert command[1] == many.index_key and command[3].upper() == "COUNT"
        assert int(command[4]) == many.INDEX_CHUNK <= 1000
    assert not [c for c in commands if c[0].upper() in ("HGETALL", "HKEYS", "HVALS", "KEYS")]
    for command in commands:
        if command[0].upper() in ("EVALSHA", "EVAL"):
            assert int(command[2]) <= 2 * many.LIST_BATCH + 1


def _text(arg: bytes) -> str:
    return arg.decode(errors="replace")
