"""LocMem waiters that are not first in line: they still follow the lock's lease.

A fair waiter woken while another is first in the queue, or a reader held up by a
waiting writer, has no expiry to wait for at that moment; once the one ahead takes
the lock (or the write permit), its lease ends at a known time, and a holder that
dies without releasing must not keep the others asleep until their own timeouts.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from distlocks.backends.base import READ, RWLOCK, WRITE, Holder
from distlocks.backends.locmem import LocMemBackend, _stores
from distlocks.locks import acquire_lease
from tests.waiting import wait_for

#: Long enough that a waiter sleeping until its own timeout fails the test's deadline.
LONG_TIMEOUT = 120.0
#: The lease of the holder that dies without releasing.
SHORT_TTL = 0.5
#: The deadline the test gives the wake-up: generous, far below LONG_TIMEOUT.
DEADLINE = 30.0


@pytest.fixture
def backend() -> Iterator[LocMemBackend]:
    location = f"waiting-{uuid.uuid4().hex}"
    yield LocMemBackend("locmem-waiting", {"LOCATION": location})
    _stores.pop(location, None)


def holder() -> Holder:
    return Holder(host="h", pid=1, thread="t", extra={})


def _in_thread(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = target()
        except BaseException as exc:  # reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_fair_waiter_behind_another_follows_the_next_holders_lease(
    backend: LocMemBackend,
) -> None:
    """The queue is [w1, w2] and the lock free: w2 is refused (not its turn) with no
    expiry to wait for. w1 then takes it with a short lease and dies: w2 gets the lock
    once that lease ends, not at its own timeout."""
    name = "fair"
    store = backend._store
    assert backend.acquire(name, "h", 60, holder()).acquired
    # w1 queues behind the holder; the holder releases: the lock is free, w1 first.
    assert not backend.acquire(name, "w1", 60, holder(), wait=60, fair=True).acquired
    assert backend.release(name, "h")
    thread, out = _in_thread(
        lambda: acquire_lease(
            backend, name, ttl=30, timeout=LONG_TIMEOUT, fair=True, auto_renew=False
        )
    )
    wait_for(lambda: len(store.queues.get(name, ())) == 2, what="w2 queued behind w1")
    # w1's turn: it takes the lock and never releases (its process died).
    assert backend.acquire(name, "w1", SHORT_TTL, holder(), wait=60, fair=True).acquired
    wait_for(lambda: "result" in out or "error" in out, DEADLINE, "w2 got the lock")
    assert "error" not in out, out
    lease = out["result"]
    assert lease.fencing_token > 0 and backend.inspect(name).owner == lease.owner
    lease.release()
    thread.join(DEADLINE)


def test_a_reader_held_up_by_a_waiting_writer_follows_the_writers_lease(
    backend: LocMemBackend,
) -> None:
    """A reader refused because a writer waits has no expiry to wait for; the writer
    then takes its permit with a short lease and dies: the reader gets in once that
    lease ends, not at its own timeout."""
    name = "rw"
    store = backend._store
    assert backend.permit_acquire(READ, name, "r0", 60, holder()).acquired
    assert not backend.permit_acquire(WRITE, name, "w", 60, holder(), wait=60).acquired
    assert not backend.permit_acquire(READ, name, "r1", 60, holder()).acquired  # writer first
    woken = threading.Event()

    def reader() -> bool:
        deadline = LONG_TIMEOUT
        while not backend.permit_acquire(READ, name, "r1", 60, holder(), wait=deadline).acquired:
            woken.set()
            backend.permit_wait(READ, name, deadline, owner="r1")
        return True

    thread, out = _in_thread(reader)
    wait_for(woken.is_set, what="the reader refused once")
    assert backend.permit_release(READ, name, "r0")
    assert backend.permit_acquire(WRITE, name, "w", SHORT_TTL, holder(), wait=60).acquired
    wait_for(lambda: "result" in out or "error" in out, DEADLINE, "the reader got in")
    assert out == {"result": True}
    assert {p.owner for p in backend.permit_holders(READ, name)} == {"r1"}
    assert store.live_waiting((RWLOCK, name)) == {}
    thread.join(DEADLINE)
