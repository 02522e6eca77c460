"""asyncio: ``alock()`` against ``redis.asyncio``'s ``Lock`` and a raw ``redis.asyncio`` floor.

Two workloads, each on one event loop of its own (created in ``setup``, closed in
``teardown``) so that every client connects once, in the warm-up:

* ``async-cycle``: one task takes and releases the same free lock in a loop (try
  once, no wait); one sample is one acquire+release;
* ``async-tasks``: 1,000 tasks run at once, each acquiring and releasing names of
  its own (never contended) for a fixed time; the figure is acquisitions per second
  over all tasks.

The three rows run on the benchmark's Redis:

* ``async-floor``: ``redis.asyncio`` with nothing on top, ``SET key token NX PX`` and
  a compare-and-delete script (the same as the synchronous ``floor``);
* ``async-distlocks``: ``async with alock(name, ttl=..., timeout=0):`` (public API:
  a fencing token, the holder's metadata, a renewal task per lease);
* ``async-redis-py``: ``redis.asyncio``'s ``Lock`` (``client.lock()``), no token.

Connections: distlocks' event-loop client holds at most ``async_pool_size``
connections (96 by default), of which a third are kept for waits on busy locks, so
acquires and releases use at most 64. The floor and redis-py get a
``BlockingConnectionPool`` of the same 64, so that 1,000 tasks share as many
connections in every row; the floor and redis-py with their default (unbounded)
pool are not measured: they would open a connection per task.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Coroutine
from typing import Any, ClassVar

from bench.base import (
    BenchError,
    Env,
    Implementation,
    Measurement,
    RunOptions,
    Workload,
    implementation,
    workload,
)
from bench.implementations import _COMPARE_AND_DELETE

CYCLE = "async-cycle"
TASKS = "async-tasks"
#: Lease of every lock taken; nothing expires mid-measurement.
TTL = 30.0
#: Connections distlocks' quick calls (acquire, release) may use with the default
#: ``async_pool_size`` of 96 (two thirds of it); the other rows' pools get as many.
POOL_SIZE = 64


class AsyncImplementation(Implementation):
    """A lock taken from a coroutine; the synchronous methods are not used."""

    family = "redis"
    servers = frozenset({"redis"})
    workloads = frozenset({CYCLE, TASKS})

    async def aopen(self) -> None:
        """Create what lives on the running loop (a client); called in the workload's loop."""

    async def aclose(self) -> None:
        """Free what :meth:`aopen` created, on the same loop."""

    async def acycle(self, name: str, ttl: float) -> None:
        raise NotImplementedError

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        raise NotImplementedError(f"{self.name} takes part in the asyncio workloads only")

    def release(self, handle: Any) -> None:
        raise NotImplementedError(f"{self.name} takes part in the asyncio workloads only")

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        raise NotImplementedError(f"{self.name} takes part in the asyncio workloads only")


class _RedisAsyncio(AsyncImplementation):
    """A ``redis.asyncio`` client with a bounded pool, one per workload loop."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.client: Any = None

    async def aopen(self) -> None:
        import redis.asyncio

        pool = redis.asyncio.BlockingConnectionPool.from_url(
            self.env.redis_url, max_connections=POOL_SIZE, timeout=30
        )
        self.client = redis.asyncio.Redis(connection_pool=pool)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            await self.client.connection_pool.disconnect()
            self.client = None


@implementation
class AsyncFloor(_RedisAsyncio):
    """redis.asyncio with nothing on top: ``SET key token NX PX`` and a compare-and-delete."""

    name = "async-floor"
    label = "redis.asyncio SET NX PX + compare-and-delete"
    role = "floor"
    distribution = "redis"

    async def aopen(self) -> None:
        await super().aopen()
        self._release = self.client.register_script(_COMPARE_AND_DELETE)

    async def acycle(self, name: str, ttl: float) -> None:
        token = uuid.uuid4().hex
        if not await self.client.set(name, token, nx=True, px=int(ttl * 1000)):
            raise BenchError(f"{self.name}: lock {name!r} was busy in an uncontended cycle")
        await self._release(keys=[name], args=[token])


@implementation
class AsyncDistlocks(AsyncImplementation):
    """distlocks through its public asyncio API: ``async with alock(name, ttl=..., timeout=0):``."""

    name = "async-distlocks"
    label = "distlocks alock() (public API)"
    role = "distlocks"
    distribution = "distlocks"
    reference = True
    key_patterns = ("distlocks-bench:*",)

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from distlocks import alock

        self._alock = alock

    async def acycle(self, name: str, ttl: float) -> None:
        async with self._alock(name, ttl=ttl, timeout=0):
            pass

    async def aclose(self) -> None:
        # The backend keeps one redis.asyncio client per event loop: close this loop's
        # on the loop, before the workload closes it.
        from distlocks import get_backend

        side = get_backend("default")._async_clients.pop(asyncio.get_running_loop(), None)
        if side is not None:
            await side.client.aclose()

    def close(self) -> None:
        from distlocks.handler import backends

        backends.reset()


@implementation
class AsyncRedisPyLock(_RedisAsyncio):
    """redis.asyncio's own ``Lock`` (``client.lock()``), non-blocking acquire."""

    name = "async-redis-py"
    label = "redis.asyncio Lock"
    role = "peer"
    distribution = "redis"

    async def acycle(self, name: str, ttl: float) -> None:
        lock = self.client.lock(name, timeout=ttl)
        if not await lock.acquire(blocking=False):
            raise BenchError(f"{self.name}: lock {name!r} was busy in an uncontended cycle")
        await lock.release()


class _AsyncWorkload(Workload):
    """A workload run on one event loop of its own."""

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._opened: list[AsyncImplementation] = []

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return issubclass(impl, AsyncImplementation) and super().supports(impl)

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self.loop is not None
        return self.loop.run_until_complete(coro)

    def setup(self, impls: list[Implementation]) -> None:
        self.loop = asyncio.new_event_loop()
        for impl in impls:
            assert isinstance(impl, AsyncImplementation)
            self._run(impl.aopen())
            self._opened.append(impl)

    def teardown(self) -> None:
        if self.loop is None:
            return
        try:
            for impl in self._opened:
                self._run(impl.aclose())
            self._opened = []
            self._run(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            self.loop = None


@workload
class AsyncCycle(_AsyncWorkload):
    """One task, one free lock: acquire (try once) and release, again and again."""

    name = CYCLE
    title = "asyncio: uncontended acquire + release cycle"
    metric = "latency"
    description = (
        "One asyncio task takes and releases the same free lock in a loop (try once, no "
        "wait), on an event loop of its own. The time of each acquire+release pair is one "
        "sample."
    )

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.iterations = options.iterations or (40 if options.quick else 5000)
        # Many short rounds, as the synchronous cycle (bench.workloads.CYCLE_ROUNDS says why).
        self.rounds = 1 if options.quick else 50
        self.batch = max(1, math.ceil(self.iterations / self.rounds))
        self.warm_up_iterations = 5 if options.quick else 300

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "iterations": self.batch * self.rounds,
            "per_round": self.batch,
            "warm_up": self.warm_up_iterations,
            "ttl_s": TTL,
        }

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, AsyncImplementation)
        count = self.warm_up_iterations if round_no < 0 else self.batch
        return self._run(self._cycles(impl, count))

    @staticmethod
    async def _cycles(impl: AsyncImplementation, count: int) -> Measurement:
        name = f"bench:{impl.name}:cycle"
        clock = time.perf_counter_ns
        cycle = impl.acycle
        latencies = [0] * count
        began = clock()
        for i in range(count):
            started = clock()
            await cycle(name, TTL)
            latencies[i] = clock() - started
        return Measurement(latencies, count, (clock() - began) / 1e9)


@workload
class AsyncTasks(_AsyncWorkload):
    """1,000 concurrent tasks on distinct names: acquisitions per second."""

    name = TASKS
    title = "asyncio: 1,000 concurrent tasks, distinct locks"
    metric = "throughput"
    description = (
        "1,000 asyncio tasks on one event loop each acquire+release names of their own "
        "(4 per task, never contended) for a fixed time, all at once; acquisitions per "
        "second over all tasks. Every row shares 64 connections among the tasks "
        "(what distlocks' default async_pool_size of 96 lets acquires and releases use; "
        "a BlockingConnectionPool of 64 for the others)."
    )
    names_per_task: ClassVar[int] = 4

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.tasks = 50 if options.quick else 1000
        self.duration = 0.1 if options.quick else 1.0
        self.rounds = 1 if options.quick else 5

    def params(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "tasks": self.tasks,
            "names_per_task": self.names_per_task,
            "duration_s": self.duration,
            "connections": POOL_SIZE,
            "ttl_s": TTL,
        }

    def warm_up(self, impl: Implementation) -> None:
        # Opens the pool's connections and loads the scripts.
        self.measure(impl, -1)

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        assert isinstance(impl, AsyncImplementation)
        duration = min(self.duration, 0.3) if round_no < 0 else self.duration
        return self._run(self._all_tasks(impl, duration))

    async def _all_tasks(self, impl: AsyncImplementation, duration: float) -> Measurement:
        loop = asyncio.get_running_loop()
        # Every task is created before the window opens, and starts together.
        start_at = loop.time() + 0.05 + self.tasks / 20_000
        stop_at = start_at + duration

        async def one(index: int) -> list[int]:
            names = [f"bench:{impl.name}:tasks:{index}:{i}" for i in range(self.names_per_task)]
            await asyncio.sleep(max(0.0, start_at - loop.time()))
            clock = time.perf_counter_ns
            cycle = impl.acycle
            latencies: list[int] = []
            i = 0
            while loop.time() < stop_at:
                started = clock()
                await cycle(names[i % self.names_per_task], TTL)
                latencies.append(clock() - started)
                i += 1
            return latencies

        results = await asyncio.gather(*(one(index) for index in range(self.tasks)))
        ended = loop.time()
        latencies = [value for chunk in results for value in chunk]
        return Measurement(latencies, len(latencies), ended - start_at)
