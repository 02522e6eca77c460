"""The Python work of one uncontended Redis cycle, lock() and alock() (issue 29's "no
regression" rows): no generator-based context manager is entered per call, since
building and driving one (a generator, its wrapper, next or anext per step) cost more
than the rest of a backend call's Python work; and alock() switches tasks no more than
the raw redis.asyncio cycle does (a ``SET NX PX`` and a compare-and-delete script).
The queue for a call slot, which the asyncio calls take inline, still fails after
ASYNC_QUEUE_TIMEOUT. Counted, not timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import redis
import redis.asyncio

from distlocks import alock, get_backend, lock
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable

ALIAS = "redis"
CYCLES = 20
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# What entering a generator-based context manager runs, sync or async.
_CM_ENTRY = {
    contextlib._GeneratorContextManager.__enter__.__code__,
    contextlib._AsyncGeneratorContextManager.__aenter__.__code__,
}


@contextlib.contextmanager
def _entered_context_managers() -> Iterator[list[str]]:
    """The generator-based context managers entered meanwhile, by where they were made."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in _CM_ENTRY:
            func = frame.f_locals["self"].gen
            code = getattr(func, "gi_code", None) or getattr(func, "ag_code", None)
            entered.append(f"{code.co_filename}:{code.co_name}" if code else repr(func))

    sys.setprofile(profile)
    try:
        yield entered
    finally:
        sys.setprofile(None)


def _sync_cycles(name: str) -> None:
    for _ in range(CYCLES):
        with lock(name, backend=ALIAS, ttl=30, timeout=0):
            pass


async def _async_cycles(name: str, n: int = CYCLES) -> None:
    for _ in range(n):
        async with alock(name, backend=ALIAS, ttl=30, timeout=0):
            pass


def test_a_sync_cycle_enters_no_generator_context_manager(name: str) -> None:
    _sync_cycles(name)  # connects, loads the scripts
    with _entered_context_managers() as entered:
        _sync_cycles(name)
    assert entered == []


def test_an_async_cycle_enters_no_generator_context_manager(name: str) -> None:
    async def main() -> list[str]:
        await _async_cycles(name)  # the loop's client, its connection, the scripts
        with _entered_context_managers() as entered:
            await _async_cycles(name)
        return entered

    assert asyncio.run(main()) == []


class _CountingLoop(asyncio.SelectorEventLoop):
    """Counts its iterations: each is one pass through the selector, one task switch
    or more."""

    iterations = 0

    def _run_once(self) -> None:
        self.iterations += 1
        super()._run_once()  # type: ignore[misc]


def _iterations_per_cycle(make: Callable[[], Any]) -> float:
    loop = _CountingLoop()
    try:
        cycles = loop.run_until_complete(make())
        loop.run_until_complete(cycles(5))  # warm: connections, scripts
        before = loop.iterations
        loop.run_until_complete(cycles(CYCLES))
        return (loop.iterations - before) / CYCLES
    finally:
        loop.close()


def test_an_async_cycle_switches_tasks_no_more_than_the_raw_client(name: str) -> None:
    url = get_backend(ALIAS).client.connection_pool.connection_kwargs
    location = f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}"

    async def raw() -> Callable[[int], Any]:
        client = redis.asyncio.Redis.from_url(location)
        release = client.register_script(_RELEASE)

        async def cycles(n: int) -> None:
            for _ in range(n):
                token = uuid.uuid4().hex
                assert await client.set(f"{name}:raw", token, nx=True, px=30000)
                assert await release(keys=[f"{name}:raw"], args=[token])

        return cycles

    async def ours() -> Callable[[int], Any]:
        return lambda n: _async_cycles(name, n)

    mine, floor = _iterations_per_cycle(ours), _iterations_per_cycle(raw)
    assert mine <= floor, (mine, floor)


def test_a_call_queued_for_a_slot_fails_after_the_queue_timeout(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(ALIAS)
    assert isinstance(backend, RedisBackend)
    monkeypatch.setattr(RedisBackend, "ASYNC_QUEUE_TIMEOUT", 0.2)

    async def main() -> None:
        side = backend._async_side()
        slots = side.calls
        taken = 0
        while not slots.locked():  # every slot busy, as with that many calls in flight
            await slots.acquire()
            taken += 1
        try:
            with pytest.raises(LockBackendUnavailable, match="no free connection within"):
                await backend.aacquire(name, uuid.uuid4().hex, 30, _holder())
        finally:
            for _ in range(taken):
                slots.release()
        # The slots are free again: the next call goes through.
        owner = uuid.uuid4().hex
        assert (await backend.aacquire(name, owner, 30, _holder())).acquired
        assert await backend.arelease(name, owner)

    asyncio.run(main())


def _holder() -> Any:
    from distlocks.locks import current_holder

    return current_holder()


class _TimerCountingLoop(asyncio.SelectorEventLoop):
    """Counts the timers scheduled on it."""

    timers = 0

    def call_at(self, when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        self.timers += 1
        return super().call_at(when, callback, *args, **kwargs)


def test_an_async_cycle_schedules_no_timer_per_call(name: str) -> None:
    """The reads' socket timeout is kept by one timer per event loop, not one per read
    (an asyncio.timeout() per read: two timers per cycle before)."""
    loop = _TimerCountingLoop()
    try:
        loop.run_until_complete(_async_cycles(name, 5))
        before = loop.timers
        loop.run_until_complete(_async_cycles(name, 50))
        assert loop.timers - before <= 2, loop.timers - before
    finally:
        loop.close()


def test_a_paused_server_times_out_an_async_call(own_redis: Any, settings: Any, name: str) -> None:
    """A server that stops answering (its writes paused longer than the socket timeout)
    gives LockBackendUnavailable from a redis.TimeoutError within about the timeout, and
    the connection the late reply was due on is not used again."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "paused": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": own_redis.url,
            "OPTIONS": {"socket_timeout": 0.3},
        },
    }
    admin = redis.Redis.from_url(own_redis.url)

    async def main() -> float:
        async with alock(name, backend="paused", timeout=0):
            pass  # connected, scripts loaded
        admin.execute_command("CLIENT", "PAUSE", 4000, "WRITE")  # scripts wait meanwhile
        started = time.monotonic()
        try:
            with pytest.raises(LockBackendUnavailable) as excinfo:
                await alock(name, backend="paused", timeout=0).acquire()
            assert isinstance(excinfo.value.__cause__, redis.TimeoutError)
            return time.monotonic() - started
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")

    try:
        elapsed = asyncio.run(main())
        assert elapsed < 3, f"took {elapsed:.1f}s"

        async def again() -> bool:
            # The acquire that timed out may have run once the pause ended: another name.
            async with alock(f"{name}:after", backend="paused", timeout=5) as lease:
                return lease.held()

        assert asyncio.run(again())
    finally:
        admin.close()


@contextlib.asynccontextmanager
async def own_connection(alias: str) -> AsyncIterator[tuple[Any, Any]]:
    """The async side of ``alias``'s Redis backend, and a connection made from its pool
    for the test alone (the backend's own calls never get it), closed at the end.
    Entered inside the event loop that the side belongs to."""
    backend = get_backend(alias)
    assert isinstance(backend, RedisBackend)
    side = backend._async_side()
    conn = side.client.connection_pool.make_connection()
    await conn.connect()
    try:
        yield side, conn
    finally:
        await conn.disconnect(nowait=True)


def test_a_reply_that_came_before_the_watch_fired_is_still_read(name: str) -> None:
    """The watch ends a late read by aborting its connection; a reply already received
    by then is read (the reader sees the end of the stream only after it), and the
    connection is closed rather than used again."""
    from distlocks.backends.redis.calls import _aread, _asend

    async def main() -> None:
        async with own_connection(ALIAS) as (side, conn):
            await _asend(conn, ("PING",))
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + 10
            while not conn._reader._buffer and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # until the reply is in the reader's buffer
            assert conn._reader._buffer
            # The read is due, and late: the watch aborts the connection first.
            side.watch.start(loop, conn, -1.0)
            side.watch._check(loop)
            assert id(conn) in side.watch.expired
            # What _aread does once its read returns: the reply, then the connection shut.
            assert await conn.read_response(timeout=math.inf) in (b"PONG", "PONG")
            assert side.watch.end(conn)

        # And a late read with nothing received is a timeout, as the client's own.
        async with own_connection(ALIAS) as (side, conn):
            conn.socket_timeout = 0.2
            await _asend(conn, ("BLPOP", f"{name}:never", 5))
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                await _aread(side, conn)
            assert time.monotonic() - started < 3
            assert not conn.is_connected

    asyncio.run(main())
