"""Django settings for the benchmarks.

The servers are started (or found through ``DISTLOCKS_TEST_REDIS_URL`` /
``DISTLOCKS_TEST_DATABASE_URL``) by :mod:`bench.run` before Django is set up; the
URLs travel in the environment, so the worker processes it spawns configure
themselves identically.

The PostgreSQL implementations work in a database of their own,
:data:`BENCH_DATABASE`, which :mod:`bench.postgres` creates and migrates on the
server of ``DISTLOCKS_TEST_DATABASE_URL`` before Django opens any connection.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from bench.base import DURABLE_DATABASE_ENV, ETCD_ENV, ZOOKEEPER_ENV
from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV

REDIS_URL = os.environ.get(REDIS_URL_ENV, "redis://127.0.0.1:6379/0")
DATABASE_URL = os.environ.get(DATABASE_URL_ENV, "")
#: Set by the runner in the ZooKeeper workloads' runs only (see bench.zookeeper).
ZOOKEEPER_LOCATION = os.environ.get(ZOOKEEPER_ENV, "")
#: The ZooKeeper session every ZooKeeper implementation asks for, in seconds: the same
#: as the lease length of the workloads, as docs/backend-zookeeper.md advises.
ZOOKEEPER_SESSION_TIMEOUT = 30.0
#: Set by the runner in the etcd workloads' runs only (see bench.etcd).
ETCD_LOCATION = os.environ.get(ETCD_ENV, "")
#: Set by the runner when the pg-cycle-durable workload runs (see bench.pg_durable).
DURABLE_DATABASE_URL = os.environ.get(DURABLE_DATABASE_ENV, "")
#: Kept apart from the test suite's databases, so a run never touches their tables.
BENCH_DATABASE = "distlocks_bench"

SECRET_KEY = "distlocks-bench-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# django-pglock's advisory() needs only a database connection, not its models.
# bench.benchapp holds the tables of the fenced-save workloads (migrated with the rest).
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "distlocks",
    "bench.benchapp",
]


def _database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": BENCH_DATABASE,
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": parts.port or 5432,
    }


# Without a PostgreSQL server (a Redis-only run) there is no database at all.
DATABASES: dict[str, dict[str, object]] = (
    {"default": _database(DATABASE_URL)} if DATABASE_URL else {}
)

DISTLOCKS_BACKENDS: dict[str, dict[str, object]] = {
    "default": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": REDIS_URL},
}
if DATABASE_URL:
    DISTLOCKS_BACKENDS["pg"] = {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "default",
        # Room for the 17 threads of the hand-off workload, each waiting on its own connection.
        "OPTIONS": {"mode": "session", "pool_size": 24},
    }
if DATABASE_URL and DURABLE_DATABASE_URL:
    # The PostgreSQL with production settings (fsync=on, synchronous_commit=on).
    DATABASES["durable"] = _database(DURABLE_DATABASE_URL)
    DISTLOCKS_BACKENDS["pg-durable"] = {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "durable",
        "OPTIONS": {"mode": "session", "pool_size": 4},
    }
    DISTLOCKS_BACKENDS["pg-durable-sync"] = {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "durable",
        "OPTIONS": {"mode": "session", "pool_size": 4, "synchronous_commit": "on"},
    }
if ZOOKEEPER_LOCATION:
    DISTLOCKS_BACKENDS["zk"] = {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        "LOCATION": ZOOKEEPER_LOCATION,
        "OPTIONS": {"session_timeout": ZOOKEEPER_SESSION_TIMEOUT, "prefix": "/distlocks-bench"},
    }
if ETCD_LOCATION:
    DISTLOCKS_BACKENDS["etcd"] = {
        "BACKEND": "distlocks.backends.etcd.EtcdBackend",
        "LOCATION": ETCD_LOCATION,
        "OPTIONS": {"prefix": "distlocks-bench"},
    }
DISTLOCKS_KEY_PREFIX = "distlocks-bench"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "root": {"handlers": ["null"], "level": "WARNING"},
}
