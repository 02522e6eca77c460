from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from distlocks import get_backend
from distlocks.backends.base import BaseBackend
from distlocks.handler import backends

#: Every backend alias the contract suite runs against.
CONTRACT_BACKENDS = ["locmem", "redis"]
#: Backends whose locks are shared between OS processes.
CROSS_PROCESS_BACKENDS = ["redis"]


@pytest.fixture(params=CONTRACT_BACKENDS)
def alias(request: pytest.FixtureRequest) -> str:
    """The alias of each backend in turn (the contract suite's parameter)."""
    return str(request.param)


@pytest.fixture(params=CROSS_PROCESS_BACKENDS)
def shared_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backend(alias: str) -> BaseBackend:
    return get_backend(alias)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name no other test uses."""
    return f"{request.node.name[:80]}:{uuid.uuid4().hex[:12]}"


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
