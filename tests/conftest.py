from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from distlocks import get_backend
from distlocks.backends.base import BaseBackend
from distlocks.handler import backends
from distlocks.testing.servers import RedisServer

#: Every backend alias the contract suite runs against.
CONTRACT_BACKENDS = ["locmem", "redis", "pg", "redlock"]
#: Backends whose locks are shared between OS processes.
CROSS_PROCESS_BACKENDS = ["redis", "pg", "redlock"]


@pytest.fixture(scope="session")
def pg_ready(django_db_setup: None) -> None:
    """The test database exists (with the registry table), and worker processes
    started by tests will use it too."""
    from django.db import connection

    os.environ["DISTLOCKS_TEST_DB_NAME"] = connection.settings_dict["NAME"]


def _prepare(request: pytest.FixtureRequest, alias: str) -> str:
    if alias.startswith("pg"):
        request.getfixturevalue("pg_ready")
    return alias


@pytest.fixture(params=CONTRACT_BACKENDS)
def alias(request: pytest.FixtureRequest) -> str:
    """The alias of each backend in turn (the contract suite's parameter)."""
    return _prepare(request, str(request.param))


@pytest.fixture(params=CROSS_PROCESS_BACKENDS)
def shared_alias(request: pytest.FixtureRequest) -> str:
    return _prepare(request, str(request.param))


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


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.close()


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
