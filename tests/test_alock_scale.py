"""alock() with many coroutines: each event loop's client has a bounded number of
connections (``OPTIONS["async_pool_size"]``), split between quick calls and blocking
waits; coroutines beyond it wait their turn instead of failing. Real Redis only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis as redis_lib

from distlocks import alock, get_backend
from distlocks.backends.redis import RedisBackend
from distlocks.checks import check_settings


@pytest.fixture
def own_alias(own_redis: Any, settings: Any) -> Any:
    """``own_alias(**options)``: a Redis backend alias on a server of the test's own."""

    def make(**options: Any) -> str:
        settings.DISTLOCKS_BACKENDS = {
            **settings.DISTLOCKS_BACKENDS,
            "own": {
                "BACKEND": "distlocks.backends.redis.RedisBackend",
                "LOCATION": own_redis.url,
                "OPTIONS": options,
            },
        }
        return "own"

    return make


def clients(url: str) -> int:
    admin = redis_lib.Redis.from_url(url)
    try:
        return len(admin.client_list(_type="normal")) - 1  # not this one
    finally:
        admin.close()


def test_a_thousand_coroutines_on_distinct_names(own_alias: Any, own_redis: Any, name: str) -> None:
    # An asyncio read timeout also counts the time the loop takes to get back to the
    # reader: with a thousand coroutines on a loaded machine that passed 1 s (a matrix
    # run), and so did a connect's (a run beside other test processes). The test is about
    # the pool's bound, so the timeouts are not what it measures.
    alias = own_alias(socket_timeout=15, socket_connect_timeout=15)
    peak = 0

    async def one(i: int) -> int:
        nonlocal peak
        async with alock(f"{name}:{i}", backend=alias, ttl=30, timeout=10) as lease:
            await asyncio.sleep(0)  # let the others in while this one holds
            peak = max(peak, clients(own_redis.url)) if i % 100 == 0 else peak
            return lease.fencing_token

    async def main() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(1000)))

    tokens = asyncio.run(main())
    assert len(tokens) == 1000 and all(token > 0 for token in tokens)
    backend = get_backend(alias)
    assert isinstance(backend, RedisBackend)
    # Never more connections than the pool allows (plus the synchronous client's).
    assert peak <= backend.async_pool_size + 2


def test_two_hundred_coroutines_queue_for_one_lock(own_alias: Any, name: str) -> None:
    alias = own_alias(async_pool_size=12)  # 8 for calls, 4 for blocking waits
    order: list[int] = []
    tokens: list[int] = []

    async def one(i: int) -> None:
        async with alock(name, backend=alias, ttl=5, timeout=120) as lease:
            order.append(i)
            tokens.append(lease.fencing_token)
            await asyncio.sleep(0.001)

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(200)))

    asyncio.run(main())
    assert sorted(order) == list(range(200))
    assert tokens == sorted(tokens) and len(set(tokens)) == 200


def test_a_tiny_pool_still_serves_everyone(own_alias: Any, name: str) -> None:
    alias = own_alias(async_pool_size=2)

    async def one(i: int) -> bool:
        async with alock(f"{name}:{i}", backend=alias, timeout=30) as lease:
            return lease.held()

    async def main() -> list[bool]:
        return await asyncio.gather(*(one(i) for i in range(100)))

    assert asyncio.run(main()) == [True] * 100


def test_killed_connections_and_a_flushed_script_cache_are_survived(
    own_alias: Any, own_redis: Any, name: str
) -> None:
    alias = own_alias()
    admin = redis_lib.Redis.from_url(own_redis.url)

    async def main() -> list[int]:
        tokens = []
        async with alock(name, backend=alias) as lease:
            tokens.append(lease.fencing_token)
        admin.script_flush()
        async with alock(name, backend=alias) as lease:  # loaded again
            tokens.append(lease.fencing_token)
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
        async with alock(name, backend=alias, timeout=5) as lease:  # reconnected once
            tokens.append(lease.fencing_token)
        return tokens

    try:
        tokens = asyncio.run(main())
    finally:
        admin.close()
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


@pytest.mark.parametrize("size", [0, 1, "64", True, 10**6])
def test_a_bad_async_pool_size_is_a_check_error(size: Any, settings: Any) -> None:
    settings.DISTLOCKS_BACKENDS = {
        "default": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": "redis://localhost:6379/0",
            "OPTIONS": {"async_pool_size": size},
        }
    }
    messages = [m.hint or m.msg for m in check_settings()]
    assert any("async_pool_size" in str(text) for text in messages), messages
