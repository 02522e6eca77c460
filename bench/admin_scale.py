"""The admin page of live locks with 100,000 live locks: the ``admin-list-100k`` workload.

Issue 15's item: "the first (cold) page load < 1 s, memory bounded (say how much),
search and status filters included". The workload takes 100,000 locks on the
benchmark's Redis (untimed, through ``RedisBackend.acquire``), then measures page views
that each read the server (``?backend=default&fresh=1``: a cold listing, as the first
viewer after a refresh interval gets it):

* ``admin100k-redis-raw``: the floor, redis-py reading every lock once (``SCAN`` +
  ``HGETALL``, pipelined), as in ``admin-list``;
* ``admin100k-index-raw``: the floor of the listing index, redis-py reading the one
  hash that the Redis backend keeps of its held locks (``HSCAN`` in chunks of 10,000
  fields) and splitting each entry into its fields;
* ``admin100k-cold``: the first page, default order (by name);
* ``admin100k-cold-search``: the same with a search (``?q=``) that matches 10 locks;
* ``admin100k-cold-status``: the same filtered by a status (``?status=ok``).

Memory: after the timed rounds, one more view of each row runs under ``tracemalloc``;
its peak (the most memory Python held at once during the view, above what it held
before) is in the parameters, with the growth of the process's resident set size over
the workload's first view of each row.

PostgreSQL is not in this workload: the benchmark's server keeps advisory locks in a
shared lock table of ``max_locks_per_transaction`` (64) x ``max_connections`` (300)
entries, about 19,200, so it cannot hold 100,000 live locks without a server setting
that the throwaway server does not change (see docs/benchmarks.md).
"""

from __future__ import annotations

import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

from bench.admin_list import AdminListing, AdminSite, RedisRaw
from bench.base import (
    BenchError,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    implementation,
    workload,
)

NAME = "admin-list-100k"
NAME_PREFIX = "bench:admin100k:"
#: The keys of the bench backend's listing index (see RedisBackend.rebuild_listing_index):
#: removed with the locks, so no entry outlives them.
INDEX_PATTERN = "distlocks-bench:listing*"
TTL = 3600.0
#: Matches 10 of the 100,000 names (``...:0123x``), 1 of the 2,000 of a quick run.
SEARCH = "0123"


def _rss_bytes() -> int:
    """The process's resident set size now (Linux), or 0."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


@implementation
class Admin100kRaw(RedisRaw):
    """redis-py: SCAN over the keys, HGETALL of every lock hash, pipelined (the floor)."""

    name = "admin100k-redis-raw"
    workloads = frozenset({NAME})
    key_patterns = (f"distlocks-bench:{{{NAME_PREFIX}*", INDEX_PATTERN)


@implementation
class Admin100kIndexRaw(RedisRaw):
    """redis-py: HSCAN of the listing index, each entry split into its fields (the
    floor of a listing read from the index)."""

    name = "admin100k-index-raw"
    label = "redis-py HSCAN of the listing index (one hash)"
    family = "redis-index"
    workloads = frozenset({NAME})
    key_patterns = (f"distlocks-bench:{{{NAME_PREFIX}*", INDEX_PATTERN)

    def view(self, page: int) -> None:
        found = 0
        cursor = 0
        while True:
            cursor, entries = self.client.hscan("distlocks-bench:listing", cursor, count=10_000)
            found += sum(1 for value in entries.values() if len(value.split(b"\0", 9)) == 10)
            if not cursor:
                break
        if not found:
            raise BenchError(f"{self.name}: no entry found")


class _ColdPage(AdminListing):
    """A view of the admin page that reads the Redis server (``fresh=1``)."""

    role = "distlocks"
    family = "redis"
    servers = frozenset({"redis"})
    workloads = frozenset({NAME})
    key_patterns = (f"distlocks-bench:{{{NAME_PREFIX}*", INDEX_PATTERN)
    #: Query parameters beyond ``backend`` and ``fresh``.
    extra: ClassVar[dict[str, str]] = {}

    def view(self, page: int) -> None:
        assert self.site is not None
        html = self.site.get({"backend": "default", "fresh": "1", **self.extra})
        if "data-lock-name=" not in html:
            raise BenchError(f"{self.name}: the page shows no lock")


@implementation
class Admin100kCold(_ColdPage):
    """The first page of the live-locks admin, read from Redis (cold listing)."""

    name = "admin100k-cold"
    label = "distlocks admin page, cold listing (Redis)"
    reference = True


@implementation
class Admin100kSearch(_ColdPage):
    """The same, with a search that matches a few names."""

    name = "admin100k-cold-search"
    label = f"distlocks admin page, cold listing, ?q={SEARCH}"
    extra: ClassVar[dict[str, str]] = {"q": SEARCH}


@implementation
class Admin100kStatus(_ColdPage):
    """The same, filtered by status."""

    name = "admin100k-cold-status"
    label = "distlocks admin page, cold listing, ?status=ok"
    extra: ClassVar[dict[str, str]] = {"status": "ok"}


@workload
class AdminList100k(Workload):
    """The live-locks page with 100,000 live locks on Redis, cold."""

    name = NAME
    title = "Admin page of live locks, 100,000 live locks (Redis), cold load"
    metric = "latency"
    unit = "page view"
    description = (
        "100,000 live locks on Redis; one sample is one view of the live-locks admin page "
        "that reads the server (a cold listing): the first page, with a search, with a "
        "status filter. The floor is redis-py reading every lock once. The memory one "
        "view takes (tracemalloc peak) is in the parameters."
    )

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.locks = 2_000 if options.quick else 100_000
        self.rounds = 1 if options.quick else 3
        self.site: AdminSite | None = None
        self.details: dict[str, dict[str, Any]] = {}
        self.taken_in_s = 0.0

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return issubclass(impl, AdminListing) and super().supports(impl)

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "locks": self.locks,
            "search": SEARCH,
            "locks_taken_in_s": self.taken_in_s,
            **self.details,
        }

    def setup(self, impls: list[Implementation]) -> None:
        from distlocks import get_backend
        from distlocks.locks import current_holder

        backend, holder = get_backend("default"), current_holder()

        def take(start: int) -> None:
            for i in range(start, min(start + 1000, self.locks)):
                name = f"{NAME_PREFIX}{i:06d}"
                if not backend.acquire(name, uuid.uuid4().hex, TTL, holder).acquired:
                    raise BenchError(f"lock {name} was busy")

        began = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(take, range(0, self.locks, 1000)))
        self.taken_in_s = round(time.monotonic() - began, 1)
        self.site = AdminSite()
        for impl in impls:
            assert isinstance(impl, AdminListing)
            impl.site = self.site

    def teardown(self) -> None:
        if self.site is not None:
            self.site.close()
            self.site = None
        # The locks go with the keys the runner removes after the run (key_patterns).

    def warm_up(self, impl: Implementation) -> None:
        assert isinstance(impl, AdminListing)
        rss = _rss_bytes()
        impl.view(1)  # the first view of this row: imports, templates, the listing
        self.details[impl.name] = {"rss_growth_first_view_mib": _mib(_rss_bytes() - rss)}

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, AdminListing)
        started = time.perf_counter_ns()
        impl.view(1)
        elapsed = time.perf_counter_ns() - started
        if round_no == self.rounds - 1:
            self._memory(impl)
        return Measurement([elapsed], 1, elapsed / 1e9)

    def _memory(self, impl: AdminListing) -> None:
        """One more view, untimed, under tracemalloc: the most memory it held at once."""
        import gc

        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            impl.view(1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        self.details[impl.name]["tracemalloc_peak_mib"] = _mib(peak - before)


def _mib(count: int) -> float:
    return round(count / 2**20, 1)
