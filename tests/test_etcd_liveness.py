"""No waiter stranded on etcd (issue 26): hundreds of asyncio waiters on one loop all
get the lock, a waiter cancelled again and again while it cleans up leaves nothing
behind and blocks nobody, and a waiter process SIGKILLed while queued holds up the
waiters behind it for seconds, not for its ttl (locks, fair locks, semaphores and
read-write locks). The election half is in tests/test_etcd_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import alock, get_backend, rwlock, semaphore
from distlocks.backends.etcd import EtcdBackend
from distlocks.locks import aacquire_lease, acquire_lease, current_holder
from distlocks.testing.etcd_server import EtcdServer, etcd_missing
from tests.test_etcd_async import backend_for, keys_under, leases
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(bool(etcd_missing()), reason=f"no etcd: {etcd_missing()}")


@pytest.fixture
def etcd(etcd_ready: str) -> EtcdBackend:
    backend = get_backend("etcd")
    assert isinstance(backend, EtcdBackend)
    return backend


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.close()


# -- item 1: any number of asyncio waiters -----------------------------------------------


def test_300_waiters_on_one_loop_all_get_the_lock(etcd: EtcdBackend, name: str) -> None:
    """More waiters than one loop ever had watch streams (256) queue on one lock with
    10 ms holds: every one of them gets it, one at a time. (Before: about 20 in 15 s,
    the others stuck behind waiters that had no watch to be woken by.)"""
    count = 300
    inside: list[int] = []
    tokens: list[int] = []
    overlaps: list[int] = []

    async def one(i: int) -> None:
        async with alock(name, backend="etcd", ttl=30, timeout=240) as lease:
            if inside:
                overlaps.append(i)
            inside.append(i)
            tokens.append(lease.fencing_token)
            await asyncio.sleep(0.01)
            inside.remove(i)

    async def main() -> None:
        # A liveness bound far above what it takes (about 20 s on a loaded 2-core
        # machine), not a benchmark.
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), 90)

    asyncio.run(main())
    assert overlaps == []
    assert len(tokens) == count
    assert tokens == sorted(set(tokens))
    assert etcd.queue(name) == []
    assert etcd.inspect(name) is None


# -- item 2: a clean-up no cancellation interrupts ------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    queued_first=st.booleans(),
    ticks=st.lists(st.integers(0, 60), min_size=1, max_size=5),
)
def test_a_waiter_cancelled_again_and_again_leaves_nothing_and_blocks_nobody(
    own_etcd: EtcdServer, queued_first: bool, ticks: list[int]
) -> None:
    """A waiter is cancelled, then cancelled again after any number of loop turns,
    repeatedly: while it waits, while it acquires, and while the clean-up of an
    earlier cancellation runs. Its lease (ttl 30) and waiter key go at once, and the
    waiter behind it gets the lock as soon as the holder releases (well within the
    30 s the leftovers would live)."""
    backend = backend_for(own_etcd.location, prefix="recancel")
    before = leases(backend)

    async def queued(count: int) -> None:
        deadline = time.monotonic() + 20
        while len(await asyncio.to_thread(backend.queue, "n")) < count:
            assert time.monotonic() < deadline, "the waiter never queued"
            await asyncio.sleep(0.01)

    async def main() -> None:
        assert (await backend.aacquire("n", "holder", 30, current_holder())).acquired
        victim = asyncio.create_task(aacquire_lease(backend, "n", ttl=30, timeout=60))
        if queued_first:
            await queued(1)
        for turns in ticks:
            for _ in range(turns):
                await asyncio.sleep(0)
            victim.cancel()
        behind = asyncio.create_task(aacquire_lease(backend, "n", ttl=30, timeout=60))
        with contextlib.suppress(asyncio.CancelledError):
            await victim
            pytest.fail("the victim got the lock while the holder held it")
        assert await backend.arelease("n", "holder")
        lease = await asyncio.wait_for(behind, 10)
        assert await lease.release()

    asyncio.run(asyncio.wait_for(main(), 60))
    wait_for(lambda: leases(backend) == before, 10, "every lease of the victim revoked")
    assert keys_under(backend, "recancel/wait/") == []
    assert keys_under(backend, "recancel/lock/") == []
    assert backend._entries == {}
    backend.close()


# -- item 3: a waiter process killed while queued -------------------------------------------

CHILD = """
import os, sys
from distlocks.backends.base import Holder
from distlocks.backends.etcd import EtcdBackend

location, kind, name = sys.argv[1:4]
backend = EtcdBackend("child", {"LOCATION": location})
holder = Holder("child", os.getpid(), "main")
if kind in ("lock", "fair"):
    result = backend.acquire(name, "child", 30, holder, wait=120, fair=kind == "fair")
else:
    permit = {"semaphore": "semaphore", "write": "write", "read": "read"}[kind]
    result = backend.permit_acquire(permit, name, "child", 30, holder, limit=1, wait=120)
print("acquired" if result.acquired else "queued", flush=True)
sys.stdin.read()  # until killed
"""


def queue_of(backend: EtcdBackend, kind: str, name: str) -> list[str]:
    if kind in ("lock", "fair"):
        return backend.queue(name)
    # A read-write lock's queue holds its readers and its writers.
    prefix = backend.family_prefix("semaphore" if kind == "semaphore" else "write", name)
    return keys_under(backend, prefix)


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "write", "read"])
def test_a_waiter_killed_while_queued_does_not_hold_up_the_next(
    etcd: EtcdBackend, etcd_ready: str, kind: str, name: str
) -> None:
    """A waiter process queues (ttl 30) and is SIGKILLed; the lock is released: the
    waiter behind the dead one gets it within 10 s, not after the dead one's 30 s
    lease. (Its waiter key now lives on a short lease of its own while it waits.) With
    "read", the dead waiter is a reader queued behind a writer and the live one a
    writer: once the first writer goes, the dead reader holds, keeping the writer out.
    """

    def take(timeout: float) -> Any:
        if kind in ("lock", "fair"):
            return acquire_lease(etcd, name, ttl=30, timeout=timeout, fair=kind == "fair")
        if kind == "semaphore":
            return semaphore(name, limit=1, backend="etcd", ttl=30, timeout=timeout).acquire()
        return rwlock(name, backend="etcd").write(ttl=30, timeout=timeout).acquire()

    first = take(5)
    waiting = 1 if kind in ("lock", "fair") else 2  # a permit's holder has a key too
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, etcd_ready, kind, name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(take(60)))
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"queued"
        assert len(queue_of(etcd, kind, name)) == waiting
        thread.start()
        wait_for(lambda: len(queue_of(etcd, kind, name)) == waiting + 1, 20, "queued behind")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        released = time.monotonic()
        first.release()
        thread.join(10)
        took = time.monotonic() - released
        assert got, f"the waiter behind a dead one did not get the lock within {took:.1f} s"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if thread.is_alive():
            thread.join(60)  # it gets the lock once the dead waiter's lease ends
        for lease in got:
            lease.release()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_live_waiter_keeps_its_place_for_longer_than_its_waiter_lease(
    own_etcd: EtcdServer, driver: str
) -> None:
    """The short lease of a waiter key is renewed while it waits (by the waiter's own
    thread, or by its loop's hub for all its waiters at once): a waiter that waits for
    several times its length keeps its waiter key, in its place, and then gets the lock."""
    backend = backend_for(own_etcd.location, prefix=f"keep-{driver}")
    backend.WAIT_TTL = 2.0
    holder = current_holder()
    assert backend.acquire("n", "holder", 30, holder).acquired
    got: list[Any] = []

    async def take_async() -> None:
        lease = await aacquire_lease(backend, "n", ttl=30, timeout=60)
        got.append(lease.fencing_token)
        assert await lease.release()

    def take() -> None:
        if driver == "sync":
            lease = acquire_lease(backend, "n", ttl=30, timeout=60)
            got.append(lease.fencing_token)
            assert lease.release()
        else:
            asyncio.run(take_async())

    thread = threading.Thread(target=take)
    thread.start()
    try:
        wait_for(lambda: len(backend.queue("n")) == 1, 20, "the waiter queued")
        [key] = keys_under(backend, f"keep-{driver}/wait/")
        created = created_revision(backend, key)
        # Three waiter leases long (the scenario's length, not a timing assertion):
        # the key must be there, the same one, all along.
        until = time.monotonic() + 3 * backend.WAIT_TTL
        while time.monotonic() < until:
            assert created_revision(backend, key) == created, "the waiter lost its place"
            time.sleep(0.1)
        assert backend.release("n", "holder")
        thread.join(20)
        assert got, "the waiter did not get the lock"
    finally:
        backend.force_release("n")
        thread.join(60)
    backend.close()


def created_revision(backend: EtcdBackend, key: str) -> int:
    """The create_revision of ``key`` (0 when it does not exist)."""
    from distlocks.backends.etcd import _b64

    answer = backend._call("/v3/kv/range", {"key": _b64(key)}, "test", "")
    kvs = answer.get("kvs") or []
    return int(kvs[0]["create_revision"]) if kvs else 0
