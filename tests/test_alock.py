"""alock: the asyncio API, with the same semantics as lock()."""

from __future__ import annotations

import asyncio
import time

import pytest

from distlocks import AsyncLease, alock, get_backend, lock
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockLost, LockNotAcquired


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_async_with_holds_and_releases(alias: str, name: str) -> None:
    async def main() -> AsyncLease:
        async with alock(name, backend=alias, ttl=10) as lease:
            assert isinstance(lease, AsyncLease)
            assert lease.held()
            assert get_backend(alias).inspect(name).owner == lease.owner
        return lease

    lease = run(main())
    assert lease.state == "released"
    assert get_backend(alias).inspect(name) is None


def test_tasks_exclude_each_other(alias: str, name: str) -> None:
    inside = 0
    most = 0

    async def worker() -> None:
        nonlocal inside, most
        for _ in range(5):
            async with alock(name, backend=alias, ttl=10, timeout=30):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.002)
                inside -= 1

    async def main() -> None:
        await asyncio.gather(*(worker() for _ in range(6)))

    run(main())
    assert most == 1


def test_sync_and_async_holders_exclude_each_other(alias: str, name: str) -> None:
    with lock(name, backend=alias, ttl=10):

        async def main() -> None:
            with pytest.raises(LockNotAcquired):
                await alock(name, backend=alias, timeout=0.2).acquire()

        run(main())


def test_waiting_does_not_block_the_event_loop(shared_alias: str, name: str) -> None:
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def main() -> None:
        stop = asyncio.Event()
        tick_task = asyncio.create_task(ticker(stop))
        holder = await alock(name, backend=shared_alias, ttl=10).acquire()
        waiter = asyncio.create_task(alock(name, backend=shared_alias, timeout=10).acquire())
        await asyncio.sleep(0.3)
        assert not waiter.done()
        released = time.monotonic()
        await holder.release()
        lease = await waiter
        granted = time.monotonic()
        await lease.release()
        stop.set()
        await tick_task
        assert granted - released < 0.5  # woken by the release

    run(main())
    assert ticks >= 20  # the loop kept running while the waiter waited


def test_async_renewal_keeps_the_lease(alias: str, name: str) -> None:
    async def main() -> AsyncLease:
        # A ttl that a pause of the test process (a full collection of the suite's heap
        # takes a few hundred ms) cannot outlast: 0.4 s lost a Redlock lease in CI once.
        async with alock(name, backend=alias, ttl=1.0) as lease:
            await asyncio.sleep(3.0)
            assert lease.held()
            assert get_backend(alias).inspect(name).owner == lease.owner
        return lease

    lease = run(main())
    assert lease.renewals >= 3


def test_async_loss_is_raised_at_exit(alias: str, name: str) -> None:
    async def main() -> None:
        lost = asyncio.Event()
        async with alock(name, backend=alias, ttl=0.6, on_lost=lambda lease: lost.set()):
            get_backend(alias).force_release(name)
            await asyncio.wait_for(lost.wait(), 2)

    with pytest.raises(LockLost):
        run(main())


def test_async_decorator(alias: str, name: str) -> None:
    @alock(name, backend=alias, timeout=0)
    async def job(x: int) -> int:
        assert get_backend(alias).inspect(name) is not None
        return x + 1

    assert run(job(1)) == 2
    assert get_backend(alias).inspect(name) is None


def test_decorators_refuse_the_wrong_kind_of_function() -> None:
    with pytest.raises(TypeError, match="use alock"):

        @lock("x")
        async def coro() -> None: ...

    with pytest.raises(TypeError, match="Use lock"):

        @alock("x")  # type: ignore[arg-type]
        def plain() -> None: ...


def test_async_reentrancy_is_per_task(alias: str, name: str) -> None:
    async def main() -> None:
        async with alock(name, backend=alias, reentrant=True) as outer:
            async with alock(name, backend=alias, reentrant=True, timeout=0) as inner:
                assert inner is outer
            assert outer.held()

            async def other_task() -> None:
                await alock(name, backend=alias, reentrant=True, timeout=0).acquire()

            with pytest.raises(LockNotAcquired):
                await asyncio.create_task(other_task())

    run(main())
    assert get_backend(alias).inspect(name) is None


def test_fair_async_waiters(alias: str, name: str) -> None:
    order: list[int] = []

    async def main() -> None:
        backend = get_backend(alias)
        holder = await alock(name, backend=alias, ttl=30).acquire()

        async def waiter(i: int) -> None:
            async with alock(name, backend=alias, timeout=30, fair=True):
                order.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(waiter(i)))
            while (backend.inspect(name).waiters or 0) < i + 1:
                await asyncio.sleep(0.005)
        await holder.release()
        await asyncio.gather(*tasks)

    run(main())
    assert order == [0, 1, 2, 3, 4]


def test_async_clients_are_per_event_loop(name: str) -> None:
    """Each asyncio.run() has its own loop; a client bound to a closed loop would fail."""
    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)

    async def use() -> int:
        async with alock(name, backend="redis") as lease:
            return lease.fencing_token

    tokens = [asyncio.run(use()) for _ in range(3)]
    assert tokens == sorted(set(tokens))
