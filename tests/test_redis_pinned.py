"""The Redis backend's per-thread connections: each thread calls on a connection of
its own from the pool (no checkout per call), given back when the thread ends, never
used by a forked child, replaced after a restart, limited in number."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
from typing import Any

import pytest
import redis as redis_lib

from distlocks import get_backend, lock
from distlocks.backends.redis import RedisBackend
from tests.waiting import wait_for


@pytest.fixture
def own(own_redis: Any, settings: Any) -> RedisBackend:
    """A Redis backend on a server of the test's own."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "own": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": own_redis.url},
    }
    backend = get_backend("own")
    assert isinstance(backend, RedisBackend)
    return backend


def in_use(backend: RedisBackend) -> int:
    return len(backend.client.connection_pool._in_use_connections)


def test_a_thread_keeps_one_connection_and_gives_it_back_when_it_ends(
    own: RedisBackend, name: str
) -> None:
    def work() -> None:
        for _ in range(20):
            with lock(name + threading.current_thread().name, backend="own", timeout=5):
                pass

    threads = [threading.Thread(target=work, name=f"t{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    gc.collect()
    # Every thread ended: their connections are back in the pool, the count with them.
    wait_for(lambda: in_use(own) == 0, what="connections given back")
    assert own._pinned_count == 0
    assert len(own.client.connection_pool._available_connections) >= 1


def test_threads_beyond_the_limit_share_the_pool(
    own: RedisBackend, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RedisBackend, "MAX_PINNED", 3)
    barrier = threading.Barrier(6)
    tokens: list[int] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with lock(f"{name}:{i}", backend="own", timeout=5) as lease:
                barrier.wait(10)  # all six at once: three pinned, three through the pool
                tokens.append(lease.fencing_token)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert len(tokens) == 6
    assert own._pinned_count <= 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_the_parents_connection(own: RedisBackend, name: str) -> None:
    with lock(name, backend="own"):
        pass
    parent_conn = own._local.slot.conn
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            for i in range(50):
                with lock(f"{name}:child:{i}", backend="own", timeout=5):
                    pass
            mine = own._local.slot.conn
            os.write(write, b"ok" if mine is not parent_conn else b"shared")
        except BaseException as exc:
            os.write(write, f"raised {exc!r}".encode())
        os._exit(0)
    os.close(write)
    answer = b""
    while chunk := os.read(read, 1024):
        answer += chunk
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"ok"
    # The parent's connection was not touched by the child: no reply out of turn.
    for i in range(50):
        with lock(f"{name}:parent:{i}", backend="own", timeout=5) as lease:
            assert lease.held()
    assert own._local.slot.conn is parent_conn


def test_a_flushed_script_cache_and_a_killed_connection_are_survived(
    own: RedisBackend, own_redis: Any, name: str
) -> None:
    with lock(name, backend="own"):
        pass
    admin = redis_lib.Redis.from_url(own_redis.url)
    admin.script_flush()
    with lock(name, backend="own") as lease:  # the script is loaded again
        assert lease.held()
    conn = own._local.slot.conn
    sock = conn._sock
    # The server ends every other client connection (a restart, an idle timeout).
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
    with lock(name, backend="own", timeout=5) as lease:  # reconnected once, quietly
        assert lease.held()
    assert own._local.slot.conn is conn and conn._sock is not sock
    admin.close()


def test_the_backend_closed_gives_a_new_connection(own: RedisBackend, name: str) -> None:
    with lock(name, backend="own"):
        pass
    old = own._local.slot.conn
    own.close()
    with lock(name, backend="own") as lease:
        assert lease.held()
    assert own._local.slot.conn is not old
    assert own._pinned_count == 1


def _wait_for_the_lock(url: str, prefix: str, name: str, out: Any, use_async: bool) -> None:
    """Another process: wait for ``name`` (held by the test), report the grant."""
    from tests.workers import setup_django

    setup_django()
    import asyncio

    from distlocks.backends.redis import RedisBackend
    from distlocks.locks import aacquire_lease, acquire_lease

    backend = RedisBackend("waiter", {"LOCATION": url, "OPTIONS": {"key_prefix": prefix}})
    if use_async:

        async def main() -> None:
            lease = await aacquire_lease(backend, name, ttl=30, timeout=60)
            out.put((lease.fencing_token, os.getpid()))
            await lease.release()

        asyncio.run(main())
        return
    lease = acquire_lease(backend, name, ttl=30, timeout=60)
    out.put((lease.fencing_token, os.getpid()))
    lease.release()


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["lock", "alock"])
def test_a_waiter_takes_the_lock_on_the_server_at_the_release(
    own: RedisBackend, own_redis: Any, name: str, use_async: bool
) -> None:
    """The waiter's blocking pop and its next attempt are sent together: the server runs
    the attempt the moment the release wakes it, even if the waiting process is frozen
    (SIGSTOP) by then. The lock is never left free for a round trip to the client."""
    admin = redis_lib.Redis.from_url(own_redis.url)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    holder = lock(name, backend="own", ttl=30).acquire()
    worker = context.Process(
        target=_wait_for_the_lock, args=(own_redis.url, own.key_prefix, name, out, use_async)
    )
    worker.start()
    try:
        blocked = lambda: admin.info("clients")["blocked_clients"] >= 1  # noqa: E731
        while True:
            wait_for(blocked, limit=60, what="the waiter blocked on the server")
            os.kill(worker.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            if blocked():
                break  # frozen with its pop (and the attempt behind it) on the server
            os.kill(worker.pid, signal.SIGCONT)  # type: ignore[arg-type]
        holder.release()
        wait_for(
            lambda: (info := own.inspect(name)) is not None and info.pid == worker.pid,
            limit=30,
            what="the frozen waiter to hold the lock",
        )
    finally:
        os.kill(worker.pid, signal.SIGCONT)  # type: ignore[arg-type]
    token, pid = out.get(timeout=60)
    worker.join(30)
    admin.close()
    assert pid == worker.pid
    assert token > holder.fencing_token
