"""Attacks on the Redis backend's asyncio direct path (one timer per loop for the reads'
socket timeout, the call slot taken inline): cancellation mid-read, reads of several
timeouts on one loop, loops that come and go, a killed or restarted server, a crowd of
coroutines on a small pool. Real servers, no mocks; conditions waited on, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from distlocks import alock, get_backend
from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable, LockLost
from distlocks.testing.servers.redis_server import RedisServer
from tests.test_redis_async_path import own_connection

HOLDER = Holder("attack-host", 1, "main")


def _settle(condition: Callable[[], bool], what: str, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        time.sleep(0.02)


async def _until(condition: Callable[[], bool], what: str, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def _alias(settings: Any, url: str, **options: Any) -> Iterator[RedisBackend]:
    alias = f"attack-{uuid.uuid4().hex[:8]}"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        alias: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": url,
            "OPTIONS": options,
        },
    }
    backend = get_backend(alias)
    assert isinstance(backend, RedisBackend)
    try:
        yield backend
    finally:
        backend.close()


def _quiet(side: Any) -> None:
    """The loop's call slots all free and its read watch empty."""
    calls = side.calls
    assert not calls._waiters, "coroutines still queued for a slot"
    assert calls._value == len(side.idle) or calls._value >= 1
    assert side.watch.deadlines == {}, side.watch.deadlines
    assert side.watch.expired == set(), side.watch.expired


# Keeps the server busy (it reads no socket meanwhile) for ARGV[1] microseconds.
_BUSY = """
local t0 = redis.call('TIME')
repeat
  local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])
return 1
"""


@contextlib.contextmanager
def _busy_server(url: str, seconds: float) -> Iterator[None]:
    """The server runs a script for ``seconds`` (less than its 5 s busy threshold, so
    it reads nothing else meanwhile): requests sent now wait in its socket buffers and
    are run, in the order they came, once it is done. Yields once it is busy."""
    admin = redis.Redis.from_url(url)
    thread = threading.Thread(
        target=admin.eval, args=(_BUSY, 0, int(seconds * 1_000_000)), daemon=True
    )
    thread.start()

    def busy() -> bool:
        probe = redis.Redis.from_url(url, socket_timeout=0.05, socket_connect_timeout=1)
        try:
            probe.ping()
            return False
        except redis.TimeoutError:
            return True
        finally:
            probe.close()

    try:
        _settle(busy, "busy")
        yield
    finally:
        thread.join(30)
        admin.close()


@pytest.mark.parametrize("how", ["cancel", "wait_for", "taskgroup"])
def test_an_acquire_cancelled_mid_read_leaves_no_lock_and_no_stale_reply(
    own_redis: RedisServer, settings: Any, name: str, how: str
) -> None:
    """The acquire is sent to a busy server, and its task cancelled while it waits for
    the reply; the server then runs it and takes the lock. Then: the next calls on the
    loop (a refused acquire of a name held by someone else) get their own answers, not
    the cancelled call's "granted"; the slot is free and the watch empty; and the lock
    the cancelled call took is given back (nobody knows its owner to renew or release
    it), instead of being held until its ttl."""
    with _alias(settings, own_redis.url, socket_timeout=10, async_pool_size=2) as backend:
        held = f"{name}:held"
        assert backend.acquire(held, "blocker", 60, HOLDER).acquired

        async def main() -> None:
            side = backend._async_side()
            async with alock(f"{name}:warm", backend=backend.alias, timeout=0):
                pass  # the loop's connection made, the scripts loaded
            acquire = alock(name, backend=backend.alias, ttl=60, timeout=0).acquire

            async def reading() -> None:
                await _until(lambda: bool(side.watch.deadlines), "reading")

            with _busy_server(own_redis.url, 3):
                if how == "cancel":
                    task = asyncio.ensure_future(acquire())
                    await reading()
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                elif how == "wait_for":
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(acquire(), 0.3)
                else:

                    async def fail_once_reading() -> None:
                        await reading()
                        raise ValueError("boom")

                    with pytest.raises(ExceptionGroup):
                        async with asyncio.TaskGroup() as group:
                            group.create_task(acquire())
                            group.create_task(fail_once_reading())
                _quiet(side)
            # The same loop, its connections reused: each call reads its own reply.
            for _ in range(5):
                refused = await backend.aacquire(held, uuid.uuid4().hex, 30, HOLDER)
                assert not refused.acquired, "read the cancelled acquire's reply"
            owner = uuid.uuid4().hex
            assert (await backend.aacquire(f"{name}:other", owner, 30, HOLDER)).acquired
            assert await backend.arelease(f"{name}:other", owner)
            _quiet(side)

        asyncio.run(main())
        # The lock the cancelled acquire took once the server went on is given back.
        _settle(lambda: backend.inspect(name) is None, "given back")


def test_reads_of_a_shorter_timeout_are_timed_by_their_own(name: str) -> None:
    """Two reads on one loop's watch, the first with a long timeout: the second, with
    a short one, still times out after its own (the watch's one timer is set for the
    earliest deadline of all, not only the first read's)."""
    from distlocks.backends.redis.calls import _aread, _asend

    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)

    async def main() -> None:
        side = backend._async_side()
        slow = side.client.connection_pool.make_connection()
        quick = side.client.connection_pool.make_connection()
        await slow.connect()
        await quick.connect()
        slow.socket_timeout, quick.socket_timeout = 60.0, 0.2
        try:
            await _asend(slow, ("BLPOP", f"{name}:never", 20))
            await _asend(quick, ("BLPOP", f"{name}:never2", 20))
            long_read = asyncio.ensure_future(_aread(side, slow))
            await _until(lambda: id(slow) in side.watch.deadlines, "the long read under way")
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                await _aread(side, quick)
            # Far less than the BLPOP's 20 s or the long read's 60 s.
            assert time.monotonic() - started < 10
            long_read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await long_read
        finally:
            await slow.disconnect(nowait=True)
            await quick.disconnect(nowait=True)

    asyncio.run(main())


def test_a_send_cancelled_while_draining_does_not_leave_its_reply_to_the_next_call(
    own_redis: RedisServer, settings: Any, name: str
) -> None:
    """A command too big for the socket buffers, to a busy server: the send waits for
    the buffer to drain and is cancelled meanwhile. The connection must not be used
    again as it is: the rest of that command would still go out, and the next call on
    it would read that command's reply as its own."""
    from distlocks.backends.redis.calls import _asend

    with _alias(settings, own_redis.url, socket_timeout=10) as backend:

        async def main() -> None:
            side = backend._async_side()
            conn = side.client.connection_pool.make_connection()
            await conn.connect()
            try:
                with _busy_server(own_redis.url, 3):
                    task = asyncio.ensure_future(
                        _asend(conn, ("SET", f"{name}:big", "x" * 20_000_000))
                    )
                    await _until(
                        lambda: conn._writer.transport.get_write_buffer_size() > 0,
                        "the send waiting for the buffer to drain",
                    )
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                await _asend(conn, ("PING",))
                assert await conn.read_response() in (b"PONG", "PONG")
            finally:
                await conn.disconnect(nowait=True)

        asyncio.run(main())


def test_a_loop_per_call_leaves_no_connections_behind(
    own_redis: RedisServer, settings: Any, name: str
) -> None:
    """asyncio.run() per call (or async_to_sync with a new loop each time): each loop's
    client and connection go once the loop is closed, instead of staying open for as
    long as the process lives (each client's connections hold its loop, so the loop,
    a weak key, was never let go)."""
    admin = redis.Redis.from_url(own_redis.url)
    with _alias(settings, own_redis.url) as backend:

        async def cycle() -> None:
            async with alock(name, backend=backend.alias, timeout=0):
                pass

        for _ in range(12):
            asyncio.run(cycle())
        threads = [threading.Thread(target=asyncio.run, args=(cycle(),)) for _ in range(4)]
        for thread in threads:  # one at a time: the same name
            thread.start()
            thread.join(30)

        def let_go() -> bool:
            import gc

            gc.collect()
            # The admin's connection, and at most the last loop's.
            return len(backend._async_clients) <= 1 and len(admin.client_list()) <= 2

        _settle(let_go, "the closed loops' clients let go")
    admin.close()


PASSWORD = "n0t-a-real-secret-4u"


def _protect(server: RedisServer) -> None:
    raw = redis.Redis.from_url(server.url)
    try:
        raw.config_set("requirepass", PASSWORD)
    finally:
        raw.close()


def test_a_killed_then_restarted_server_with_a_password(
    own_redis: RedisServer, settings: Any, name: str
) -> None:
    """Killed while connections idle: the next calls fail with LockBackendUnavailable
    within about the timeouts, the password in no message; restarted on the same port,
    the idle connections (broken) are replaced and the calls go through again."""
    _protect(own_redis)
    url = f"redis://:{PASSWORD}@127.0.0.1:{own_redis.port}/0"
    with _alias(settings, url, socket_timeout=0.5, socket_connect_timeout=0.5) as backend:

        async def cycles(n: int) -> None:
            mine = f"{name}:{uuid.uuid4().hex}"
            for _ in range(n):
                async with alock(mine, backend=backend.alias, timeout=0, ttl=5):
                    pass

        async def main() -> None:
            side = backend._async_side()
            await asyncio.gather(*(cycles(3) for _ in range(4)))  # several idle connections
            assert len(side.idle) >= 2
            own_redis.kill()
            for call in (
                lambda: backend.aacquire(name, uuid.uuid4().hex, 5, HOLDER),
                lambda: backend.arelease(name, uuid.uuid4().hex),
                lambda: cycles(1),
            ):
                started = time.monotonic()
                with pytest.raises(LockBackendUnavailable) as excinfo:
                    await call()
                assert time.monotonic() - started < 5
                chain: BaseException | None = excinfo.value
                while chain is not None:
                    assert PASSWORD not in str(chain), chain
                    chain = chain.__cause__ or chain.__context__
            _quiet(side)
            own_redis.start(own_redis.port)
            _protect(own_redis)
            await asyncio.gather(*(cycles(3) for _ in range(4)))
            _quiet(side)

        asyncio.run(main())


def test_a_crowd_on_a_small_pool_with_the_server_stalled_past_the_timeout(
    own_redis: RedisServer, settings: Any
) -> None:
    """1,000 alock() at once on 4 call slots; the server stalls for longer than the
    socket timeout meanwhile, so the calls then in flight time out. Each coroutine gets
    a lease or LockBackendUnavailable, or (a loaded machine) LockLost for a lease whose
    ttl ran out before its release got through (nothing else, nothing hangs); afterwards the
    slots are free, the watch is empty, calls go through, and no lock is left held past
    its ttl (a timed-out acquire's give-back may fail while the server is still stalled:
    logged, and the lock lapses)."""
    with _alias(settings, own_redis.url, socket_timeout=0.5, async_pool_size=6) as backend:
        names = [f"crowd:{i}" for i in range(1000)]
        ttl = 3
        early_losses: list[float] = []

        async def one(lock_name: str) -> str:
            began = time.monotonic()
            try:
                async with alock(lock_name, backend=backend.alias, timeout=0, ttl=ttl):
                    await asyncio.sleep(0)
            except LockBackendUnavailable:
                return "unavailable"
            except LockLost:
                # On a loaded machine a holder's renewal and release can wait behind the
                # crowd (or time out in the stall) until its ttl has run out: the lease
                # lapsed, and LockLost at release is the loud report it must be. A loss
                # any sooner would be a lock taken from its holder (by a give-back).
                lost_after = time.monotonic() - began
                if lost_after < ttl * 0.99:
                    early_losses.append(lost_after)
                return "lost"
            return "held"

        async def main() -> dict[str, int]:
            side = backend._async_side()
            async with alock("crowd:warm", backend=backend.alias, timeout=0):
                pass
            with _busy_server(own_redis.url, 1.5):
                tasks = [asyncio.ensure_future(one(n)) for n in names]
                # The first calls in flight are timed out by the watch meanwhile.
                await _until(lambda: sum(t.done() for t in tasks) >= 4, "timed out")
            outcomes = await asyncio.gather(*tasks)
            _quiet(side)
            async with alock("crowd:after", backend=backend.alias, timeout=0):
                pass
            _quiet(side)
            return {o: outcomes.count(o) for o in set(outcomes)}

        counts = asyncio.run(main())
        assert set(counts) <= {"held", "unavailable", "lost"}, counts
        assert early_losses == [], early_losses  # lost only once its ttl had run out
        assert counts.get("unavailable", 0) >= 1, counts  # the stall was felt
        _settle(lambda: all(backend.inspect(n) is None for n in names), "every lock given back")


def test_an_acquire_timed_out_by_the_watch_is_given_back(
    own_redis: RedisServer, settings: Any, name: str
) -> None:
    """The server runs the acquire only after the read's timeout (its reply lost to a
    closed connection): the caller gets LockBackendUnavailable from redis.TimeoutError,
    and the lock the script took anyway is given back, not held until its ttl."""
    # The server stalls for 1 s: past the acquire's timeout, and less than two, so the
    # give-back (sent once the acquire timed out) is answered. A longer stall makes the
    # give-back time out too: logged, and the lock lapses with its ttl.
    with _alias(settings, own_redis.url, socket_timeout=0.6) as backend:

        async def main() -> None:
            async with alock(f"{name}:warm", backend=backend.alias, timeout=0):
                pass
            with _busy_server(own_redis.url, 1.0):
                with pytest.raises(LockBackendUnavailable) as excinfo:
                    await alock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
                assert isinstance(excinfo.value.__cause__, redis.TimeoutError)

        asyncio.run(main())
        _settle(lambda: backend.inspect(name) is None, "given back")


def test_an_error_reply_read_after_the_watch_fired_still_shuts_the_connection(
    name: str,
) -> None:
    """The watch aborted the connection just as an error reply came (NOSCRIPT here):
    the error is raised, and the connection is closed, as after any reply read from an
    aborted connection; not left open in name with its transport gone, where the next
    call's script load would be written to nothing."""
    from distlocks.backends.redis.calls import _aread, _asend

    async def main() -> None:
        async with own_connection("redis") as (side, conn):
            await _asend(conn, ("EVALSHA", "0" * 40, 1, f"{name}:k"))
            await _until(lambda: bool(conn._reader._buffer), "the reply received")
            loop = asyncio.get_running_loop()
            side.watch.start(loop, conn, -1.0)  # late: the watch aborts it first
            side.watch._check(loop)
            with pytest.raises(redis.exceptions.NoScriptError):
                await _aread(side, conn)
            assert not conn.is_connected
            _quiet(side)

    asyncio.run(main())


def test_a_release_cancelled_while_queued_for_a_slot_still_frees_the_lock(
    settings: Any, own_redis: RedisServer, name: str
) -> None:
    """The end of an ``async with alock()`` block is cancelled (a timeout, a task
    group) while its release waits for a call slot: the renewal has stopped already,
    so unless the release still happens the lock stays held, by nobody, for its ttl."""
    with _alias(settings, own_redis.url, async_pool_size=2) as backend:

        async def main() -> None:
            side = backend._async_side()
            lease = await alock(name, backend=backend.alias, ttl=60, timeout=0).acquire()
            taken = 0
            while not side.calls.locked():  # every slot busy
                await side.calls.acquire()
                taken += 1
            try:
                task = asyncio.ensure_future(lease.release())
                await _until(lambda: bool(side.calls._waiters), "the release queued")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                for _ in range(taken):
                    side.calls.release()

        asyncio.run(main())
        _settle(lambda: backend.inspect(name) is None, "freed")
