"""The admin page of live locks with many live locks: implementations and a workload.

Issue 7's benchmark: "with 10,000 live locks the page still answers fast". The
workload ``admin-list`` takes that many locks on the benchmark's Redis and as many on
its PostgreSQL (untimed), then measures, per server:

* ``admin-<server>-raw``: the raw client reading every lock once, the floor: redis-py
  walking the keys with SCAN and reading each lock hash (HGETALL, pipelined 1,000 at a
  time); psycopg running the listing's own query over ``pg_locks`` and the registry
  and fetching every row;
* ``admin-<server>-first``: a view of the page that reads the server
  (``?backend=<alias>&fresh=1``): the listing, the statuses of every lock, the sort,
  the counts and one page of rows rendered;
* ``admin-<server>-reused``: another page of a listing read moments before (the
  snapshot every viewer shares), page after page: what paging, sorting, filtering and
  reloading cost once the listing is read.

One sample is one page view (one full read, for the floors), timed from the request
to the rendered HTML. The admin view is called in-process, as Django's URL resolver
would call it, with a request from ``RequestFactory`` and a signed-in superuser that
needs no database: the middleware stack and the network are left out, since they cost
the same whatever the number of locks.

The PostgreSQL locks are taken by one session, through the backend's own acquisition
statement (one pooled connection per lock would need 10,000 server connections): the
registry rows and ``pg_locks`` entries are those of real holders.
"""

from __future__ import annotations

import time
import uuid
from types import ModuleType
from typing import Any, ClassVar

from bench.base import (
    BenchError,
    Env,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    implementation,
    workload,
)

NAME = "admin-list"
#: The page's URL, as the admin site serves it.
LIST_URL = "/admin/distlocks/livelock/"
#: Lock names: ``bench:`` as every workload's, so the runner's clean-up finds them.
NAME_PREFIX = "bench:admin:"
#: The aliases of :mod:`bench.settings`.
ALIASES = {"redis": "default", "postgres": "pg"}
#: Lease of the Redis locks: outlives the longest run.
TTL = 3600.0


class _Operator:
    """The viewer: a superuser, without a database row (nothing here is stored)."""

    pk = id = 1
    username = "bench"
    is_active = is_staff = is_superuser = is_authenticated = True
    is_anonymous = False

    def get_username(self) -> str:
        return self.username

    def has_perm(self, perm: str, obj: Any = None) -> bool:
        return True

    def has_perms(self, perms: Any, obj: Any = None) -> bool:
        return True

    def has_module_perms(self, app_label: str) -> bool:
        return True


class AdminListing(Implementation):
    """One way of listing the live locks of one server; only in ``admin-list``."""

    workloads = frozenset({NAME})
    distribution = "distlocks"
    key_patterns = (f"distlocks-bench:{{{NAME_PREFIX}*", "distlocks-bench:listing*")

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.site: AdminSite | None = None

    def view(self, page: int) -> None:
        """One page view (or one full read, for a floor); ``page`` varies the page."""
        raise NotImplementedError

    # Not a lock: the lock workloads never run these implementations.
    def try_acquire(self, name: str, ttl: float) -> Any | None:
        raise NotImplementedError(f"{self.name} lists locks; it takes none")

    def release(self, handle: Any) -> None:
        raise NotImplementedError(f"{self.name} lists locks; it takes none")

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        raise NotImplementedError(f"{self.name} lists locks; it takes none")


class _Page(AdminListing):
    """A view of the admin page, restricted to this implementation's server."""

    role = "distlocks"
    #: Read the server for every view (``fresh``), or page through a reused listing.
    fresh: ClassVar[bool]

    def view(self, page: int) -> None:
        assert self.site is not None
        alias = ALIASES[self.family]
        params = (
            {"backend": alias, "fresh": "1"} if self.fresh else {"backend": alias, "p": str(page)}
        )
        if "data-lock-name=" not in self.site.get(params):
            raise BenchError(f"{self.name}: the page shows no lock")


@implementation
class RedisRaw(AdminListing):
    """redis-py: SCAN over the keys, HGETALL of every lock hash, pipelined (the floor)."""

    name = "admin-redis-raw"
    label = "redis-py SCAN + HGETALL of every lock"
    role = "floor"
    family = "redis"
    servers = frozenset({"redis"})
    distribution = "redis"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        import redis

        self.client = redis.Redis.from_url(env.redis_url)

    def view(self, page: int) -> None:
        found = 0
        for keys in _batches(self.client.scan_iter(match="distlocks-bench:{*}:lock", count=10_000)):
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            found += sum(1 for fields in pipe.execute() if fields)
        if not found:
            raise BenchError(f"{self.name}: no lock found")

    def close(self) -> None:
        self.client.close()


@implementation
class RedisFirst(_Page):
    """The admin page of the Redis backend, read from the server at each view."""

    name = "admin-redis-first"
    label = "distlocks admin page, listing read (Redis)"
    family = "redis"
    servers = frozenset({"redis"})
    reference = True
    fresh = True


@implementation
class RedisReused(_Page):
    """Further pages of a Redis listing read moments before."""

    name = "admin-redis-reused"
    label = "distlocks admin page, listing reused (Redis)"
    family = "redis"
    servers = frozenset({"redis"})
    fresh = False


@implementation
class PostgresRaw(AdminListing):
    """psycopg: the listing's query over pg_locks and the registry, every row fetched."""

    name = "admin-pg-raw"
    label = "psycopg listing query, all rows fetched"
    role = "floor"
    family = "postgres"
    servers = frozenset({"postgres"})
    distribution = "psycopg"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        import psycopg

        from bench.postgres import bench_conninfo

        self.conn = psycopg.connect(bench_conninfo(env), autocommit=True)

    def view(self, page: int) -> None:
        from distlocks.backends.postgres import _LOCKS

        if not self.conn.execute(_LOCKS).fetchall():
            raise BenchError(f"{self.name}: no lock found")

    def close(self) -> None:
        self.conn.close()


@implementation
class PostgresFirst(_Page):
    """The admin page of the PostgreSQL backend, read from the server at each view."""

    name = "admin-pg-first"
    label = "distlocks admin page, listing read (PostgreSQL)"
    family = "postgres"
    servers = frozenset({"postgres"})
    reference = True
    fresh = True


@implementation
class PostgresReused(_Page):
    """Further pages of a PostgreSQL listing read moments before."""

    name = "admin-pg-reused"
    label = "distlocks admin page, listing reused (PostgreSQL)"
    family = "postgres"
    servers = frozenset({"postgres"})
    fresh = False


def _delete_redis_locks() -> None:
    """Delete the keys of the workload's Redis locks (and their fencing counters)."""
    import redis

    from bench.base import Env

    client = redis.Redis.from_url(Env.from_environ().redis_url)
    try:
        pattern = f"distlocks-bench:{{{NAME_PREFIX}*"
        for keys in _batches(client.scan_iter(match=pattern, count=10_000), 500):
            client.delete(*keys)
    finally:
        client.close()


def _batches(keys: Any, size: int = 1000) -> Any:
    batch: list[Any] = []
    for key in keys:
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class AdminSite:
    """The Django admin, switched on for the workload's duration (the benchmark's own
    settings have no admin), and requests to the live-locks page."""

    def __init__(self) -> None:
        from django.conf import settings
        from django.test.utils import override_settings

        # The URLconf: a module of its own, filled in once the admin can be imported.
        urls = ModuleType("bench_admin_urls")
        self._settings = override_settings(
            INSTALLED_APPS=[
                *settings.INSTALLED_APPS,
                "django.contrib.admin",
                "django.contrib.auth",
                "django.contrib.sessions",
                "django.contrib.messages",
            ],
            ROOT_URLCONF=urls,
            TEMPLATES=[
                {
                    "BACKEND": "django.template.backends.django.DjangoTemplates",
                    "APP_DIRS": True,
                    "OPTIONS": {
                        "context_processors": [
                            "django.template.context_processors.request",
                            "django.contrib.auth.context_processors.auth",
                            "django.contrib.messages.context_processors.messages",
                        ]
                    },
                }
            ],
            STATIC_URL="/static/",
        )
        self._settings.enable()
        from django.contrib import admin
        from django.test import RequestFactory
        from django.urls import clear_url_caches, path, resolve

        from distlocks.admin import LiveLockAdmin

        urls.urlpatterns = [path("admin/", admin.site.urls)]  # type: ignore[attr-defined]
        clear_url_caches()
        self.view = resolve(LIST_URL).func
        self.factory = RequestFactory()
        # Pages of a listing are reused for the whole run (the first views bypass it).
        self._ttl = LiveLockAdmin.snapshot_ttl
        LiveLockAdmin.snapshot_ttl = 3600.0
        self.rows_per_page = LiveLockAdmin.list_per_page

    def get(self, params: dict[str, str]) -> str:
        request = self.factory.get(LIST_URL, params)
        request.user = _Operator()
        response = self.view(request)
        response.render()
        if response.status_code != 200:
            raise BenchError(f"the live-locks page answered {response.status_code}")
        return str(response.content.decode())

    def close(self) -> None:
        from distlocks import livelocks
        from distlocks.admin import LiveLockAdmin

        LiveLockAdmin.snapshot_ttl = self._ttl
        livelocks.snapshots.clear()
        self._settings.disable()


@workload
class AdminList(Workload):
    """The live-locks page with many live locks on Redis and on PostgreSQL."""

    name = NAME
    title = "Admin page of live locks, 10,000 live locks per server"
    metric = "latency"
    unit = "page view"
    description = (
        "10,000 live locks on Redis and 10,000 on PostgreSQL; one sample is one view of "
        "the live-locks admin page restricted to one server: read from the server "
        "(first), or another page of the listing read moments before (reused). The "
        "floor is the raw client reading every lock once."
    )

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.locks = 200 if options.quick else 10_000
        self.rounds = 1 if options.quick else 5
        #: Views per round and implementation (the reused pages are cheap: more of them).
        self.views = {"first": 1 if options.quick else 3, "reused": 3 if options.quick else 20}
        self.site: AdminSite | None = None
        self.rows_per_page = 0
        self._pg: Any = None
        self._page = 0
        self._redis_locks = False

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return issubclass(impl, AdminListing) and super().supports(impl)

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "locks_per_server": self.locks,
            "views_per_round": self.views,
            "rows_per_page": self.rows_per_page,
        }

    def setup(self, impls: list[Implementation]) -> None:
        servers = set().union(*(impl.servers for impl in impls))
        if "redis" in servers:
            self._redis_locks = True
            self._take_redis_locks()
        if "postgres" in servers:
            self._take_postgres_locks()
        self.site = AdminSite()
        self.rows_per_page = self.site.rows_per_page
        for impl in impls:
            assert isinstance(impl, AdminListing)
            impl.site = self.site

    def _take_redis_locks(self) -> None:
        from distlocks import get_backend
        from distlocks.locks import current_holder

        backend, holder = get_backend(ALIASES["redis"]), current_holder()
        for i in range(self.locks):
            if not backend.acquire(f"{NAME_PREFIX}{i:05d}", uuid.uuid4().hex, TTL, holder).acquired:
                raise BenchError(f"lock {NAME_PREFIX}{i:05d} was busy")

    def _take_postgres_locks(self) -> None:
        import psycopg

        from distlocks import get_backend
        from distlocks.backends.postgres import _ACQUIRE, TRY
        from distlocks.locks import current_holder

        backend, holder = get_backend(ALIASES["postgres"]), current_holder()
        statement = _ACQUIRE.format(lock=TRY)
        self._pg = psycopg.connect(**backend._connect_kwargs())
        with self._pg.pipeline():
            for i in range(self.locks):
                name = f"{NAME_PREFIX}{i:05d}"
                params = backend._params(name, uuid.uuid4().hex, 30.0, holder)
                self._pg.execute(statement, params)

    def teardown(self) -> None:
        if self.site is not None:
            self.site.close()
            self.site = None
        if self._pg is not None:
            self._pg.close()  # its advisory locks end with the session
            self._pg = None
        if self._redis_locks:
            # Removed now, not with the run's clean-up: a later workload that lists the
            # live locks (admin-list-100k) must not see them.
            self._redis_locks = False
            _delete_redis_locks()
        # The registry rows go with the database clean-up.

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, AdminListing)
        views = self.views["reused" if getattr(impl, "fresh", True) is False else "first"]
        count = 1 if round_no < 0 else views
        pages = max(1, -(-self.locks // self.rows_per_page))
        if isinstance(impl, _Page) and not impl.fresh:
            impl.view(1)  # the listing is read (untimed); the views below reuse it
        clock = time.perf_counter_ns
        latencies = []
        began = time.perf_counter()
        for _ in range(count):
            self._page = self._page % pages + 1
            started = clock()
            impl.view(self._page)
            latencies.append(clock() - started)
        return Measurement(latencies, len(latencies), time.perf_counter() - began)
