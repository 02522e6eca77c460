"""Hypothesis profiles and the backends the stateful and property tests run on.

Two profiles, chosen by ``HYPOTHESIS_PROFILE``:

``bounded`` (the default, used by ``make test``)
    Few examples of short runs: the whole directory takes about two minutes on a
    2-core machine. It still draws new examples on every run.
``fuzz`` (``make fuzz``)
    Many more examples and longer runs, with the rules that restart servers, and
    the example database (``.hypothesis/``) so a failure found once is replayed first.

The profiles are applied per test (``profile()``), never loaded globally, so other
tests of the suite that use Hypothesis keep their own settings.

The Redis and Redlock machines run on servers of their own (started here, once per
session): they kill every client connection and restart the servers, which must not
disturb the rest of the suite. Redis Cluster runs on the session cluster
(``redis_cluster``), PostgreSQL on the test database.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import override_settings
from hypothesis import HealthCheck, settings

from distlocks.testing.servers import RedisClusterSet, RedisServer

PROFILE_ENV = "HYPOTHESIS_PROFILE"

# Every step talks to real servers: a step takes milliseconds, and a rule that waits
# for a lease to run out takes a second. Hypothesis's "too slow" checks are about
# data generation, which is cheap here; the time goes to I/O on purpose.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "bounded",
    max_examples=6,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    # A failure prints a reproduce_failure blob; nothing is written to the tree.
    database=None,
    print_blob=True,
)
settings.register_profile(
    "fuzz",
    # FUZZ_EXAMPLES / FUZZ_STEPS trade depth for time (the defaults take hours).
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "400")),
    stateful_step_count=int(os.environ.get("FUZZ_STEPS", "60")),
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)


def profile_name() -> str:
    name = os.environ.get(PROFILE_ENV, "bounded")
    return name if name in ("bounded", "fuzz") else "bounded"


def profile(**overrides: Any) -> settings:
    """The settings of the selected profile, with ``overrides`` (e.g. fewer examples
    for a slow backend)."""
    return settings(settings.get_profile(profile_name()), **overrides)


def fuzzing() -> bool:
    return profile_name() == "fuzz"


#: pytest-timeout's limit for one test: a fuzz run of one machine takes minutes.
TEST_TIMEOUT = 4 * 3600 if fuzzing() else 300


@pytest.fixture(scope="session")
def stateful_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis server for the machines alone (they kill its clients and restart it)."""
    server = RedisServer(tmp_path_factory.mktemp("stateful-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stateful_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """Three Redis masters for the Redlock machine alone."""
    base = tmp_path_factory.mktemp("stateful-redlock")
    servers = [RedisServer(base / f"m{i}").start() for i in range(3)]
    yield servers
    for server in servers:
        server.stop()


def _redis(location: str | list[str], backend: str = "redis.RedisBackend") -> dict[str, Any]:
    return {
        "BACKEND": f"distlocks.backends.{backend}",
        "LOCATION": location,
        "OPTIONS": {"key_prefix": "distlocks-stateful"},
    }


@pytest.fixture
def stateful_aliases(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Settings with the machines' aliases added; yields what each alias runs on:
    ``{"sf-redis": RedisServer, "sf-redlock": [RedisServer]*3, "sf-cluster": cluster}``
    (only those the test asked for, by fixture, are started)."""
    config = dict(django_settings.DISTLOCKS_BACKENDS)
    servers: dict[str, Any] = {}
    config["sf-locmem"] = {"BACKEND": "distlocks.backends.locmem.LocMemBackend"}
    wanted = (
        request.node.callspec.params.get("machine_alias", "")
        if hasattr(request.node, "callspec")
        else ""
    )
    if wanted in ("", "sf-redis"):
        server: RedisServer = request.getfixturevalue("stateful_redis")
        config["sf-redis"] = _redis(server.url)
        servers["sf-redis"] = server
    if wanted in ("", "sf-redlock"):
        masters: list[RedisServer] = request.getfixturevalue("stateful_masters")
        config["sf-redlock"] = _redis([m.url for m in masters], "redlock.RedlockBackend")
        servers["sf-redlock"] = masters
    if wanted == "sf-cluster":
        cluster: RedisClusterSet = request.getfixturevalue("redis_cluster")
        config["sf-cluster"] = _redis(cluster.url)
        servers["sf-cluster"] = cluster
    if wanted.startswith("pg"):
        request.getfixturevalue("pg_ready")
    with override_settings(DISTLOCKS_BACKENDS=config):
        yield servers


def base_dir() -> Path:
    return Path(__file__).resolve().parent
