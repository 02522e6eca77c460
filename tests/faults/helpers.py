"""Small helpers shared by the scenario modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from tests.faults.scenario import Scenario

MakeScenario = Callable[[str], Scenario]


def redis_config(url: str, **options: Any) -> dict[str, Any]:
    """A DISTLOCKS_BACKENDS entry for a Redis at ``url`` (the suite's key prefix)."""
    return {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": url,
            "OPTIONS": options}  # fmt: skip


def session_redis_port() -> int:
    """The port of the Redis server the test session started (or was given)."""
    from django.conf import settings

    return int(urlsplit(settings.REDIS_URL).port or 6379)


def newer_write(token: int) -> Callable[[dict[str, Any]], bool]:
    """Matches an accepted write by a holder whose token is above ``token``."""
    return lambda e: e["kind"] == "write" and e["accepted"] and e["token"] > token


def of(kind: str, proc: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    """Matches an event of ``kind`` by ``proc`` with the given field values."""
    return lambda e: (
        e["kind"] == kind
        and e.get("proc") == proc
        and all(e.get(key) == value for key, value in fields.items())
    )
