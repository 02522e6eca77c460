"""Cancelling an asyncio acquisition whose backend call runs in a worker thread.

PostgreSQL, ZooKeeper and Redlock locks, and every backend's permits, run their
acquisition in a worker thread (BaseBackend._take_in_thread). Cancelling the caller
cannot stop that thread: whatever it then takes (the lock, a permit, a place in the
wait queue) must be given back once it finishes, and the cancellation must not wait
for it. Each test holds the thread at the start of the backend's own acquire until
the cancellation is through, then lets it go on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from distlocks import alock, arwlock, asemaphore, get_backend
from distlocks.backends.base import SEMAPHORE, WRITE, BaseBackend, Holder

HOLDER = Holder("cancel-host", 1, "main")
READY = {"zk": "zk_ready", "pg": "pg_ready", "etcd": "etcd_ready"}


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def cancel_while_the_thread_is_held(
    backend: BaseBackend, method: str, start: Callable[[], Any], patch: pytest.MonkeyPatch
) -> None:
    """Start ``start()`` as a task, hold the worker thread at the start of
    ``backend.<method>``, cancel the task, check the cancellation came promptly,
    then let the thread go on and wait until it has finished."""
    real = getattr(backend, method)
    entered, cancelled, finished = threading.Event(), threading.Event(), threading.Event()

    def held_back(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        cancelled.wait(10)
        try:
            return real(*args, **kwargs)
        finally:
            finished.set()

    patch.setattr(backend, method, held_back)

    async def main() -> float:
        task = asyncio.create_task(start())
        while not entered.is_set():
            await asyncio.sleep(0.005)
        began = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        took = time.monotonic() - began
        cancelled.set()
        return took

    try:
        took = run(main())
    finally:
        cancelled.set()
    # The canceller did not wait for the thread (held until after the cancellation).
    assert took < 3
    assert finished.wait(10), "the worker thread did not finish"
    patch.undo()


def settle(condition: Callable[[], bool], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        time.sleep(0.02)


def lock_free(backend: BaseBackend, name: str) -> Callable[[], bool]:
    """True once a new owner takes ``name`` without waiting (nothing held and, for a
    fair try, nobody queued ahead); it gives the lock back at once."""

    def probe() -> bool:
        if not backend.acquire(name, "probe", 10, HOLDER, fair=True).acquired:
            return False
        assert backend.release(name, "probe")
        return True

    return probe


def permit_free(backend: BaseBackend, kind: str, name: str) -> Callable[[], bool]:
    """True once a new owner takes the only permit (limit 1) of ``name`` without
    waiting: no permit held and no waiter queued ahead; it gives it back at once."""

    def probe() -> bool:
        if not backend.permit_acquire(kind, name, "probe", 10, HOLDER, limit=1).acquired:
            return False
        assert backend.permit_release(kind, name, "probe")
        return True

    return probe


@pytest.mark.parametrize(
    ("alias", "busy"),
    [("zk", False), ("zk", True), ("pg", False), ("redlock", False)],
)
def test_a_cancelled_alock_leaves_no_lock_and_no_waiter(
    request: pytest.FixtureRequest, alias: str, busy: bool, name: str
) -> None:
    """Free name: the thread takes the lock after the cancel; it is released. Busy
    name (ZooKeeper queues a waiter node that lives as long as the session): the
    thread joins the queue after the cancel; it leaves it again."""
    if alias in READY:
        request.getfixturevalue(READY[alias])
    backend = get_backend(alias)
    if busy:
        assert backend.acquire(name, "blocker", 30, HOLDER).acquired
    with pytest.MonkeyPatch.context() as patch:
        cancel_while_the_thread_is_held(
            backend,
            "acquire",
            lambda: alock(name, backend=alias, ttl=30, timeout=5).acquire(),
            patch,
        )
    if busy:
        assert backend.inspect(name).owner == "blocker"  # type: ignore[union-attr]
        assert backend.release(name, "blocker")
    settle(lock_free(backend, name), "free again")
    assert backend.inspect(name) is None


@pytest.mark.parametrize(
    ("alias", "kind", "busy"),
    [
        ("zk", SEMAPHORE, False),
        ("zk", SEMAPHORE, True),
        ("zk", WRITE, False),
        ("pg", SEMAPHORE, False),
    ],
)
def test_a_cancelled_permit_acquire_leaves_no_permit_and_no_waiter(
    request: pytest.FixtureRequest, alias: str, kind: str, busy: bool, name: str
) -> None:
    """asemaphore()/arwlock().write(): the permit the thread takes after the cancel is
    given back, and a waiter it queued leaves the queue."""
    if alias in READY:
        request.getfixturevalue(READY[alias])
    backend = get_backend(alias)
    if busy:
        assert backend.permit_acquire(kind, name, "blocker", 30, HOLDER, limit=1).acquired

    def start() -> Any:
        if kind == SEMAPHORE:
            return asemaphore(name, limit=1, backend=alias, ttl=30, timeout=5).acquire()
        return arwlock(name, backend=alias).write(ttl=30, timeout=5).acquire()

    with pytest.MonkeyPatch.context() as patch:
        cancel_while_the_thread_is_held(backend, "permit_acquire", start, patch)
    if busy:
        assert [p.owner for p in backend.permit_holders(kind, name)] == ["blocker"]
        assert backend.permit_release(kind, name, "blocker")
    settle(permit_free(backend, kind, name), "free again")
    assert backend.permit_holders(kind, name) == []
