"""The sample project's tests, on the distlocks plugin's fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis
from django.db import connection
from shop import services
from shop.models import Stock

import distlocks
from distlocks import get_backend, lock
from distlocks.backends.locmem import LocMemBackend
from distlocks.backends.postgres import PostgresBackend
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockNotAcquired, StaleFencingToken


def test_distlocks_and_its_plugin_come_from_one_installation(
    request: pytest.FixtureRequest,
) -> None:
    plugin = request.config.pluginmanager.get_plugin("distlocks")
    assert plugin is not None, "the plugin was not loaded through its entry point"
    home = Path(distlocks.__file__).parent
    assert Path(str(plugin.__file__)).is_relative_to(home)
    strays = {
        name: module.__file__
        for name, module in sys.modules.items()
        if (name == "distlocks" or name.startswith("distlocks."))
        and getattr(module, "__file__", None)
        and not Path(module.__file__).is_relative_to(home)
    }
    assert strays == {}
    print(f"\nSAMPLE distlocks={home}")


def test_report_runs_once_locmem(distlocks_locmem: LocMemBackend) -> None:
    assert get_backend() is distlocks_locmem
    assert isinstance(distlocks_locmem, LocMemBackend)
    with lock("nightly-report"):
        with pytest.raises(LockNotAcquired):
            services.nightly_report()
    assert services.nightly_report() == "done"


def test_report_runs_once_redis(distlocks_redis: RedisBackend, distlocks_redis_url: str) -> None:
    assert isinstance(get_backend(), RedisBackend)
    client = redis.Redis.from_url(distlocks_redis_url, decode_responses=True)
    try:
        with lock("nightly-report") as lease:
            # The lock is in that server, under the test's own key prefix.
            key = f"{distlocks_redis.key_prefix}:{{nightly-report}}:lock"
            assert client.hget(key, "owner") == lease.owner
            with pytest.raises(LockNotAcquired):
                services.nightly_report()
        assert client.exists(key) == 0
    finally:
        client.close()
    assert services.nightly_report() == "done"
    print(f"\nSAMPLE redis={distlocks_redis_url}")


def _advisory_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return int(cursor.fetchone()[0])


def test_restock_is_fenced_on_postgres(distlocks_postgres: PostgresBackend) -> None:
    assert isinstance(get_backend(), PostgresBackend)
    with lock("stock:A1") as first:
        Stock(sku="A1", count=5).save(fencing_token=first)
        assert _advisory_locks() == 1
    assert _advisory_locks() == 0

    second = services.restock("A1", 3)
    assert second.fencing_token > first.fencing_token
    assert Stock.objects.get(sku="A1").count == 8

    # The first holder, paused past its lease, writes late: refused, nothing written.
    late = Stock.objects.get(sku="A1")
    late.count = 0
    with pytest.raises(StaleFencingToken):
        late.save(fencing_token=first.fencing_token)
    assert Stock.objects.get(sku="A1").count == 8
