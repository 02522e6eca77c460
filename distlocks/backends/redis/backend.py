"""The class named in ``BACKEND``: :class:`RedisBackend`, the modules of this
package put together (see the package's docstring for which holds what).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from django.conf import settings

from distlocks.backends.redis.config import _SENTINEL_SCHEMES, _positive, parse_location
from distlocks.backends.redis.listing import RedisListing


class RedisBackend(RedisListing):
    """Locks on one Redis server (or a django-redis cache's server), on a Redis
    Cluster, or on the primary that Sentinel names.

    ``LOCATION``: a ``redis://``, ``rediss://`` or ``unix://`` URL, a
    ``redis+cluster://`` or a ``redis+sentinel://`` one (:mod:`.config`); or
    ``CACHE``, the alias of a django-redis cache. ``OPTIONS``: those in
    :attr:`option_keys`.

    The contract's methods come from the classes below it, one concern each: listing
    (:mod:`.listing`), permits (:mod:`.permits`), the lock recipe (:mod:`.lock`), on
    running scripts (:mod:`.calls`), the clients (:mod:`.clients`) and the key layout
    (:mod:`.keys`).
    """

    wakes_on_release = True

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION", "CACHE"})
    option_keys: ClassVar[frozenset[str] | None] = frozenset(
        {
            "socket_timeout",
            "socket_connect_timeout",
            "async_pool_size",
            "listing_index",
            "key_prefix",
            "client_kwargs",
            "sentinel_kwargs",
        }
    )

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location, cache = config.get("LOCATION"), config.get("CACHE")
        if (location is None) == (cache is None):
            problems.append(
                "set exactly one of LOCATION (a redis://, rediss://, unix://, "
                "redis+cluster:// or redis+sentinel:// URL) "
                "or CACHE (the alias of a django-redis cache)"
            )
        if location is not None:
            if not isinstance(location, str):
                problems.append(f"LOCATION must be a URL string, not {type(location).__name__}")
            else:
                try:
                    parse_location(location)
                except ValueError as exc:
                    problems.append(str(exc))
        if cache is not None:
            caches = getattr(settings, "CACHES", {})
            if not isinstance(cache, str) or cache not in caches:
                problems.append(f"CACHE {cache!r} is not an alias defined in CACHES")
            elif not str(caches[cache].get("BACKEND", "")).startswith("django_redis."):
                problems.append(
                    f"CACHE {cache!r} must be a django-redis cache "
                    f"(BACKEND 'django_redis.cache.RedisCache'); use LOCATION otherwise"
                )
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            _positive(options, "socket_timeout", problems)
            _positive(options, "socket_connect_timeout", problems)
            size = options.get("async_pool_size", cls.DEFAULT_ASYNC_POOL_SIZE)
            if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= 100_000:
                problems.append(
                    f"OPTIONS['async_pool_size'] must be an int from 2 to 100,000 (connections "
                    f"per event loop), not {size!r}"
                )
            index = options.get("listing_index", True)
            if not isinstance(index, bool):
                problems.append(
                    f"OPTIONS['listing_index'] must be True or False (keep an index the "
                    f"live-locks listing reads instead of every lock), not {index!r}"
                )
            # The global DISTLOCKS_KEY_PREFIX has a check of its own (E007).
            prefix = options.get("key_prefix", "default")
            if not isinstance(prefix, str) or not prefix or set("{}") & set(prefix):
                problems.append(
                    f"OPTIONS['key_prefix'] {prefix!r} must be a non-empty str without braces"
                )
            kwargs = options.get("client_kwargs", {})
            if not isinstance(kwargs, Mapping):
                problems.append("OPTIONS['client_kwargs'] must be a dict of redis-py arguments")
            sentinel_kwargs = options.get("sentinel_kwargs")
            if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
                problems.append(
                    "OPTIONS['sentinel_kwargs'] must be a dict of redis-py arguments "
                    "for the connections to the Sentinels (e.g. {'password': ...})"
                )
            elif sentinel_kwargs is not None and not (
                isinstance(location, str) and location.lower().startswith(_SENTINEL_SCHEMES)
            ):
                problems.append(
                    "OPTIONS['sentinel_kwargs'] is only read with a redis+sentinel:// LOCATION"
                )
        return problems
