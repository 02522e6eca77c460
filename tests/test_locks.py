"""The backend contract: every test runs against every backend in CONTRACT_BACKENDS."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from distlocks import get_backend, lock, lock_many
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.lease import Lease
from distlocks.signals import lock_acquired, lock_lost, lock_released


def wait_until_free(alias: str, name: str, limit: float = 5.0) -> None:
    """Block until the server no longer has ``name`` (bounded, checked, not slept)."""
    backend = get_backend(alias)
    deadline = time.monotonic() + limit
    while backend.inspect(name) is not None:
        assert time.monotonic() < deadline, f"{name} still held after {limit}s"
        time.sleep(0.01)


def test_with_block_holds_then_releases(alias: str, name: str) -> None:
    backend = get_backend(alias)
    with lock(name, backend=alias, ttl=10) as lease:
        assert isinstance(lease, Lease)
        assert lease.held()
        assert lease.name == name
        assert lease.backend == alias
        info = backend.inspect(name)
        assert info is not None
        assert info.owner == lease.owner
        assert info.fencing_token == lease.fencing_token
    assert not lease.held()
    assert lease.state == "released"
    assert backend.inspect(name) is None


def test_second_holder_is_refused_while_held(alias: str, name: str) -> None:
    with lock(name, backend=alias, ttl=10):
        with pytest.raises(LockNotAcquired) as excinfo, lock(name, backend=alias, timeout=0):
            pytest.fail("acquired a lock that was held")
        assert excinfo.value.name == name
        assert "tried once" in str(excinfo.value)


def test_waiter_gets_the_lock_after_release(alias: str, name: str) -> None:
    holder = lock(name, backend=alias, ttl=10).acquire()
    released_at: list[float] = []

    def release_later() -> None:
        time.sleep(0.2)
        released_at.append(time.monotonic())
        holder.release()

    thread = threading.Thread(target=release_later)
    thread.start()
    lease = lock(name, backend=alias, ttl=10, timeout=5).acquire()
    granted_at = time.monotonic()
    thread.join()
    try:
        assert released_at and granted_at >= released_at[0]
        assert lease.fencing_token > holder.fencing_token
    finally:
        lease.release()


def test_timeout_runs_out(alias: str, name: str) -> None:
    with lock(name, backend=alias, ttl=10):
        start = time.monotonic()
        with pytest.raises(LockNotAcquired) as excinfo:
            lock(name, backend=alias, timeout=0.3).acquire()
        waited = time.monotonic() - start
    assert waited >= 0.3
    assert "after waiting 0.3s" in str(excinfo.value)


def test_fencing_tokens_strictly_increase(alias: str, name: str) -> None:
    tokens = []
    for _ in range(5):
        with lock(name, backend=alias, ttl=5) as lease:
            tokens.append(lease.fencing_token)
    assert tokens == sorted(set(tokens)) and len(tokens) == 5


def test_fencing_tokens_increase_across_force_release(alias: str, name: str) -> None:
    backend = get_backend(alias)
    first = lock(name, backend=alias, ttl=10).acquire()
    assert backend.force_release(name) is True
    assert backend.force_release(name) is False
    second = lock(name, backend=alias, ttl=10).acquire()
    try:
        # The counter moved at the force release too, so no token is reused.
        # The counter moved at the force release too, past the evicted holder's token.
        assert second.fencing_token > first.fencing_token + 1
    finally:
        second.release()


def test_tokens_are_per_name(alias: str, name: str) -> None:
    """Each name has its own counter: taking "a" again and again does not move "b"."""
    backend = get_backend(alias)
    with lock(name + ":b", backend=alias) as b:
        pass
    for _ in range(3):
        with lock(name + ":a", backend=alias):
            pass
    assert backend.fencing_counter(name + ":b") == b.fencing_token


def test_release_is_idempotent(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=5).acquire()
    assert lease.release() is True
    assert lease.release() is False
    assert lease.state == "released"


def test_expired_lease_never_releases_the_next_holder(alias: str, name: str) -> None:
    stale = lock(name, backend=alias, ttl=0.2, auto_renew=False).acquire()
    if get_backend(alias).expires_on_server:
        wait_until_free(alias, name)
    else:  # held until its connection ends: end it
        get_backend(alias).force_release(name)
    fresh = lock(name, backend=alias, ttl=10, timeout=0).acquire()
    try:
        assert stale.release() is False
        assert stale.state == "lost"
        info = get_backend(alias).inspect(name)
        assert info is not None and info.owner == fresh.owner
        assert fresh.held()
    finally:
        fresh.release()


def test_local_deadline_marks_lease_lost(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=0.1, auto_renew=False).acquire()
    deadline = time.monotonic() + 5
    while lease.held():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert lease.state == "lost"
    with pytest.raises(LockLost, match="ran out"):
        lease.ensure_held()


def test_extend_pushes_expiry(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=1, auto_renew=False).acquire()
    try:
        before = lease.expires_at
        lease.extend(30)
        assert lease.ttl == 30
        assert lease.expires_at is not None and before is not None
        assert lease.expires_at > before
        info = get_backend(alias).inspect(name)
        assert info is not None
        if get_backend(alias).expires_on_server:
            assert info.renewals == 1
            assert info.expires_in is not None and info.expires_in.total_seconds() > 20
    finally:
        lease.release()


def test_extend_of_a_lost_lease_raises(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=10).acquire()
    get_backend(alias).force_release(name)
    with pytest.raises(LockLost):
        lease.extend()
    assert lease.state == "lost"


def test_with_block_raises_lock_lost_when_lost_inside(alias: str, name: str) -> None:
    with pytest.raises(LockLost) as excinfo, lock(name, backend=alias, ttl=10) as lease:
        get_backend(alias).force_release(name)
    assert excinfo.value.lease is lease


def test_body_exception_wins_over_lock_lost(alias: str, name: str) -> None:
    with pytest.raises(KeyError), lock(name, backend=alias, ttl=10):
        get_backend(alias).force_release(name)
        raise KeyError("from the body")


def test_decorator_serialises_calls(alias: str, name: str) -> None:
    inside = 0
    most_inside = 0
    guard = threading.Lock()

    @lock(name, backend=alias, ttl=10, timeout=10)
    def critical(i: int) -> int:
        nonlocal inside, most_inside
        with guard:
            inside += 1
            most_inside = max(most_inside, inside)
        time.sleep(0.005)
        with guard:
            inside -= 1
        return i * 2

    results: list[int] = []
    threads = [threading.Thread(target=lambda i=i: results.append(critical(i))) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [i * 2 for i in range(8)]
    assert most_inside == 1


def test_decorator_with_timeout_zero_raises_when_busy(alias: str, name: str) -> None:
    @lock(name, backend=alias, timeout=0)
    def job() -> str:
        return "ran"

    assert job() == "ran"
    with lock(name, backend=alias), pytest.raises(LockNotAcquired):
        job()


def test_signals_carry_the_lease(alias: str, name: str) -> None:
    seen: list[tuple[str, Lease]] = []

    def on_acquired(sender: object, lease: Lease, **kwargs: object) -> None:
        seen.append(("acquired", lease))

    def on_released(sender: object, lease: Lease, **kwargs: object) -> None:
        seen.append(("released", lease))

    def on_lost(sender: object, lease: Lease, reason: str, **kwargs: object) -> None:
        seen.append(("lost", lease))

    lock_acquired.connect(on_acquired)
    lock_released.connect(on_released)
    lock_lost.connect(on_lost)
    try:
        with lock(name, backend=alias) as first:
            pass
        with pytest.raises(LockLost), lock(name, backend=alias) as second:
            get_backend(alias).force_release(name)
    finally:
        lock_acquired.disconnect(on_acquired)
        lock_released.disconnect(on_released)
        lock_lost.disconnect(on_lost)
    mine = [(kind, lease) for kind, lease in seen if lease.name == name]
    assert mine == [
        ("acquired", first),
        ("released", first),
        ("acquired", second),
        ("lost", second),
    ]


def test_on_lost_callback_runs_once(alias: str, name: str) -> None:
    calls: list[Lease] = []
    lease = lock(name, backend=alias, on_lost=calls.append).acquire()
    get_backend(alias).force_release(name)
    assert lease.release() is False
    assert not lease.held()
    assert calls == [lease]


def test_acquire_is_retry_safe_for_the_same_owner(backend, name: str) -> None:  # type: ignore[no-untyped-def]
    from distlocks.locks import current_holder

    first = backend.acquire(name, "owner-1", 5, current_holder())
    again = backend.acquire(name, "owner-1", 5, current_holder())
    other = backend.acquire(name, "owner-2", 5, current_holder())
    try:
        assert first.acquired and again.acquired
        assert again.fencing_token == first.fencing_token
        assert not other.acquired
        if backend.expires_on_server:
            assert other.remaining is not None and 0 < other.remaining <= 5
    finally:
        assert backend.release(name, "owner-1") is True


def test_inspect_records_the_holder(alias: str, name: str) -> None:
    import os
    import socket

    backend = get_backend(alias)
    with lock(name, backend=alias, ttl=20) as lease:
        info = backend.inspect(name)
        listed = [i for i in backend.iter_locks() if i.name == name]
    assert info is not None
    assert info.name == name
    assert info.host == socket.gethostname()
    assert info.pid == os.getpid()
    assert info.thread == threading.current_thread().name
    assert info.acquired_at is not None and info.held_for is not None
    assert info.held_for.total_seconds() < 10
    assert info.ttl == 20
    assert [i.owner for i in listed] == [lease.owner]


def test_lock_many_takes_all(alias: str, name: str) -> None:
    names = [f"{name}:c", f"{name}:a", f"{name}:b", f"{name}:a"]
    with lock_many(names, backend=alias, ttl=10) as leases:
        assert list(leases) == sorted(set(names))
        assert all(lease.held() for lease in leases.values())
    assert all(get_backend(alias).inspect(n) is None for n in names)


def test_lock_many_is_all_or_none(alias: str, name: str) -> None:
    backend = get_backend(alias)
    with lock(f"{name}:b", backend=alias):
        with (
            pytest.raises(LockNotAcquired),
            lock_many([f"{name}:a", f"{name}:b", f"{name}:c"], backend=alias, timeout=0.2),
        ):
            pytest.fail("lock_many got a held lock")
        # "a" was taken first (sorted order) and must have been given back.
        assert backend.inspect(f"{name}:a") is None
        assert backend.inspect(f"{name}:c") is None


def test_lock_many_in_opposite_orders_does_not_deadlock(alias: str, name: str) -> None:
    names = [f"{name}:{i}" for i in range(4)]
    done: list[int] = []
    errors: list[BaseException] = []

    def worker(order: list[str]) -> None:
        try:
            for _ in range(10):
                with lock_many(order, backend=alias, ttl=5, timeout=10):
                    done.append(1)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(names,)),
        threading.Thread(target=worker, args=(list(reversed(names)),)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert len(done) == 20


def test_threads_lose_no_increment(alias: str, name: str) -> None:
    counter = {"value": 0}

    def worker() -> None:
        for _ in range(20):
            with lock(name, backend=alias, ttl=5, timeout=30):
                value = counter["value"]
                time.sleep(0.0005)  # the race window the lock must close
                counter["value"] = value + 1

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counter["value"] == 100


def test_decorating_a_generator_function_is_refused(alias: str, name: str) -> None:
    with pytest.raises(TypeError, match="generator function"):

        @lock(name, backend=alias)
        def gen() -> Iterator[int]:
            yield 1


def test_failing_acquired_receiver_does_not_orphan_the_lease(alias: str, name: str) -> None:
    def boom(sender: object, lease: Lease, **kwargs: object) -> None:
        raise RuntimeError("receiver failed")

    lock_acquired.connect(boom)
    try:
        with pytest.raises(RuntimeError, match="receiver failed"):
            lock(name, backend=alias).acquire()
    finally:
        lock_acquired.disconnect(boom)
    assert get_backend(alias).inspect(name) is None


def test_lock_many_checks_arguments_at_the_call(alias: str) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        lock_many(["ok", ""], backend=alias)  # no `with`: the call itself raises
