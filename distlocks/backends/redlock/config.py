"""The Redlock backend's configuration: ``LOCATION``'s masters and ``OPTIONS``, the
problems :meth:`~RedlockConfig.validate_config` reports, the even-masters check, and a
master's URL as messages may show it (without credentials)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from django.core.checks import CheckMessage, Warning

from distlocks.backends.base import BaseBackend
from distlocks.backends.capabilities import Listing, Waiting
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redlock.quorum import quorum
from distlocks.redaction import redact_url

#: The ID of the system-check warning for an even number of masters.
W_EVEN_MASTERS = "distlocks.W002"
EVEN_MASTERS = (
    "A Redlock backend with an even number of masters tolerates no more failures than one fewer."
)

MIN_MASTERS = 3
DEFAULT_DRIFT_FACTOR = 0.01
DEFAULT_DRIFT_MARGIN = 0.002
_REDIS_OPTIONS = frozenset(
    {"socket_timeout", "socket_connect_timeout", "key_prefix", "client_kwargs"}
)
_OPTIONS = _REDIS_OPTIONS | {"drift_factor", "drift_margin"}
_SCHEMES = ("redis", "rediss", "unix")


def describe_url(url: str) -> str:
    """A master's URL without its credentials, for messages and logs."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _server_of(url: str) -> tuple[str, ...]:
    """What identifies the Redis server a URL points at (databases of one server are
    one server: they fail together)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return ("unix", parts.path)
    return ("tcp", (parts.hostname or "localhost").lower(), str(parts.port or 6379))


def _number(options: Mapping[str, Any], key: str, low: float, high: float | None) -> str | None:
    value = options.get(key)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or value < low or (high is not None and value >= high):
        limit = f"{low:g} <= value < {high:g}" if high is not None else f">= {low:g}"
        return f"OPTIONS['{key}'] must be a number ({limit}), not {value!r}"
    return None


class RedlockConfig(Listing, Waiting, BaseBackend):
    """Checks a Redlock backend's settings before anything connects."""

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location = config.get("LOCATION")
        example = (
            "e.g. ['redis://redis-1:6379/0', 'redis://redis-2:6379/0', 'redis://redis-3:6379/0']"
        )
        if isinstance(location, str):
            problems.append(
                f"LOCATION must be a list of at least {MIN_MASTERS} Redis URLs, one per "
                f"independent master, not one URL string ({example}); for a single server "
                f"use distlocks.backends.redis.RedisBackend"
            )
        elif not isinstance(location, list | tuple):
            got = "missing" if location is None else f"a {type(location).__name__}"
            problems.append(
                f"LOCATION must be a list of at least {MIN_MASTERS} Redis URLs, one per "
                f"independent master ({example}); it is {got}"
            )
        else:
            problems.extend(cls._location_problems(alias, list(location), config))
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            unknown = set(options) - _OPTIONS
            if unknown:
                problems.append(
                    f"unknown OPTIONS key(s) {', '.join(sorted(map(str, unknown)))}; "
                    f"RedlockBackend accepts {', '.join(sorted(_OPTIONS))}"
                )
            for problem in (
                _number(options, "drift_factor", 0.0, 1.0),
                _number(options, "drift_margin", 0.0, None),
            ):
                if problem:
                    problems.append(problem)
        return problems

    @classmethod
    def _location_problems(
        cls, alias: str, location: list[Any], config: Mapping[str, Any]
    ) -> list[str]:
        problems: list[str] = []
        if len(location) < MIN_MASTERS:
            problems.append(
                f"LOCATION lists {len(location)} master(s); Redlock needs at least "
                f"{MIN_MASTERS} independent Redis masters (with fewer, losing one loses the "
                f"quorum); for a single server use distlocks.backends.redis.RedisBackend"
            )
        seen: dict[tuple[str, ...], str] = {}
        options = config.get("OPTIONS") or {}
        redis_options = (
            {k: v for k, v in options.items() if k in _REDIS_OPTIONS}
            if isinstance(options, Mapping)
            else {}
        )
        for index, url in enumerate(location):
            if not isinstance(url, str) or urlsplit(url).scheme not in _SCHEMES:
                shown = redact_url(url) if isinstance(url, str) else f"a {type(url).__name__}"
                problems.append(
                    f"LOCATION[{index}] = {shown!r} must be a URL starting with redis://, "
                    f"rediss:// or unix://"
                )
                continue
            # The single-node checks (the URL itself, the options) apply to every master.
            single = {"LOCATION": url, "OPTIONS": redis_options}
            own = RedisBackend.validate_config(alias, single)
            problems.extend(problem for problem in own if problem not in problems)
            if own:
                continue  # a URL that does not parse names no server to compare
            server = _server_of(url)
            if server in seen:
                problems.append(
                    f"LOCATION[{index}] points at the same Redis server as {seen[server]!r}; "
                    f"each master must be a separate server (databases of one server fail "
                    f"together, and one server must not count twice toward the quorum)"
                )
            seen.setdefault(server, describe_url(url))
        return problems

    @classmethod
    def check_config(cls, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        messages = super().check_config(alias, config)
        location = config.get("LOCATION")
        if not messages and isinstance(location, list | tuple) and len(location) % 2 == 0:
            count = len(location)
            messages.append(
                Warning(
                    EVEN_MASTERS,
                    hint=f"DISTLOCKS_BACKENDS[{alias!r}] lists {count} masters: a quorum is "
                    f"{quorum(count)}, so it survives {count - quorum(count)} failure(s), as "
                    f"{count - 1} masters would. Use an odd number (3, 5, 7).",
                    id=W_EVEN_MASTERS,
                )
            )
        return messages
