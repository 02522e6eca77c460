"""Lease lifecycle: renewal, loud loss, wake-on-release, fairness, reentrancy."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from distlocks import get_backend, lock, lock_many
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.lease import Lease
from distlocks.signals import lock_released
from distlocks.testing.servers import RedisServer
from tests import workers
from tests.waiting import wait_for

# -- renewal ----------------------------------------------------------------------


@pytest.mark.slow
def test_renewed_lease_is_never_stolen_by_another_process(
    shared_alias: str, name: str, tmp_path: Path
) -> None:
    """ttl=1 s, held for 5 s: renewal keeps it; a second process never gets in."""
    result = tmp_path / "result"
    ctx = multiprocessing.get_context("spawn")
    with lock(name, backend=shared_alias, ttl=1) as lease:
        thief = ctx.Process(
            target=workers.try_to_steal, args=(shared_alias, name, 4.5, str(result))
        )
        thief.start()
        thief.join(60)
        assert thief.exitcode == 0
        assert lease.held()
    attempts, stolen = map(int, result.read_text().split())
    assert attempts > 20
    assert stolen == 0
    assert lease.renewals >= 6  # about one every ttl/3


def test_lock_deleted_from_under_its_holder_is_detected(alias: str, name: str) -> None:
    ttl = 1.5
    lost = threading.Event()
    with pytest.raises(LockLost) as excinfo:
        with lock(name, backend=alias, ttl=ttl, on_lost=lambda lease: lost.set()) as lease:
            wait_for(lambda: lease.renewals >= 1, what="first renewal")
            deleted_at = time.monotonic()
            get_backend(alias).force_release(name)
            assert lost.wait(ttl / 3 + 1.0), "loss not detected"
            detected_after = time.monotonic() - deleted_at
            assert not lease.held()
            with pytest.raises(LockLost):
                lease.ensure_held()
    assert excinfo.value.lease is lease
    assert "renewal" in excinfo.value.reason
    assert detected_after <= ttl / 3 + 0.5


def test_one_renewal_thread_for_many_leases(alias: str, name: str) -> None:
    leases = [lock(f"{name}:{i}", backend=alias, ttl=2).acquire() for i in range(30)]
    try:
        wait_for(lambda: all(lease.renewals >= 1 for lease in leases), what="renewals")
        renewers = [t for t in threading.enumerate() if t.name == f"distlocks-renewer:{alias}"]
        assert len(renewers) == 1
        assert all(lease.held() for lease in leases)
    finally:
        for lease in leases:
            lease.release()


def test_no_renewal_without_auto_renew(alias: str, name: str) -> None:
    lease = lock(name, backend=alias, ttl=0.3, auto_renew=False).acquire()
    wait_for(lambda: not lease.held(), what="expiry")
    assert lease.renewals == 0
    assert lease.state == "lost"


def test_max_hold_stops_renewal_and_reports_the_loss(alias: str, name: str) -> None:
    lost = threading.Event()
    # A 1 s lease (not 0.3 s): its first renewal must land within the ttl, which a
    # busy machine delayed past 0.3 s on Redlock's three servers.
    lease = lock(
        name, backend=alias, ttl=1, max_hold=1.5, on_lost=lambda lease: lost.set()
    ).acquire()
    # Nobody calls held(): the renewal thread itself must report the loss.
    assert lost.wait(15)
    assert lease.renewals >= 1
    assert "max_hold" in lease.lost_reason
    assert lease.release() is False


def test_renewal_stops_at_release(alias: str, name: str) -> None:
    from distlocks.renewal import renewer

    lease = lock(name, backend=alias, ttl=1.5).acquire()
    wait_for(lambda: lease.renewals >= 1, what="renewal")
    lease.release()
    renewals = lease.renewals
    # The renewer drops the lease at its next turn (within ttl/3) and never renews it again.
    wait_for(lambda: all(entry[2]() is not lease for entry in renewer(alias)._heap), what="drop")
    assert lease.renewals == renewals
    assert get_backend(alias).inspect(name) is None


def test_unreachable_server_during_renewal_loses_the_lease(
    own_redis: RedisServer, name: str
) -> None:
    options = {"socket_timeout": 0.2, "socket_connect_timeout": 0.2}
    config = {
        "default": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": own_redis.url,
            "OPTIONS": options,
        }
    }
    lost = threading.Event()
    with override_settings(DISTLOCKS_BACKENDS=config):
        lease = lock(name, ttl=1, on_lost=lambda lease: lost.set()).acquire()
        own_redis.kill()
        killed_at = time.monotonic()
        assert lost.wait(5)
        # Reported when the lease ran out, not before (the server might come back).
        assert time.monotonic() - killed_at <= 1.0 + 0.5
        assert "ConnectionError" in lease.lost_reason


# -- pauses -----------------------------------------------------------------------


@pytest.mark.slow
def test_paused_holder_learns_it_lost_the_lease(
    shared_alias: str, name: str, tmp_path: Path
) -> None:
    """SIGSTOP past the TTL: another holder gets in; after SIGCONT the first one knows."""
    if not get_backend(shared_alias).expires_on_server:
        pytest.skip("a paused PostgreSQL session keeps its lock: nothing to lose")
    log = tmp_path / "holder.log"
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=workers.hold_and_report, args=(shared_alias, name, 1.0, str(log)))
    holder.start()
    try:
        wait_for(lambda: log.exists() and "alive" in log.read_text(), what="holder start")
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGSTOP)
        with lock(name, backend=shared_alias, ttl=10, timeout=10) as lease:
            taken_at = time.monotonic()
            os.kill(holder.pid, signal.SIGCONT)
            holder.join(20)
        assert holder.exitcode == 0
    finally:
        if holder.is_alive():
            os.kill(holder.pid, signal.SIGCONT)  # type: ignore[arg-type]
            holder.kill()
    lines = log.read_text().splitlines()
    first_token = int(lines[0].split()[1])
    alive = [float(line.split()[1]) for line in lines if line.startswith("alive")]
    assert lines[-1].startswith("lost"), lines[-3:]
    assert lease.fencing_token > first_token
    # The paused holder never believed it held the lock once the other one had it.
    assert max(alive) < taken_at


# -- waiting ----------------------------------------------------------------------


@pytest.fixture
def slow_timer_alias() -> Iterator[str]:
    """A Redis backend whose blocking waits time out only after 4 s, so a wait that
    ends sooner was ended by a release, not by a timer."""
    config = dict(settings.DISTLOCKS_BACKENDS)
    config["slowtimer"] = {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": settings.REDIS_URL,
        "OPTIONS": {"socket_timeout": 5.0},
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = get_backend("slowtimer")
        assert isinstance(backend, RedisBackend)
        assert backend.wait_chunk >= 4
        yield "slowtimer"


@pytest.fixture(params=["locmem", "slowtimer", "pg"])
def waking_alias(request: pytest.FixtureRequest) -> str:
    if request.param == "slowtimer":
        return str(request.getfixturevalue("slow_timer_alias"))
    if request.param == "pg":  # waits in the server's own lock queue
        request.getfixturevalue("pg_ready")
    return str(request.param)


def _run_waiters(alias: str, name: str, count: int, fair: bool) -> list[tuple[int, float, float]]:
    """``count`` threads queue up (one after another) behind a held lock; each holds it
    briefly. Returns (waiter index, granted at, released at) in grant order."""
    backend = get_backend(alias)
    events: list[tuple[int, float, float]] = []
    guard = threading.Lock()
    errors: list[BaseException] = []

    def waiter(i: int) -> None:
        try:
            with lock(name, backend=alias, ttl=30, timeout=30, fair=fair):
                granted = time.monotonic()
                time.sleep(0.005)
                released = time.monotonic()
                with guard:
                    events.append((i, granted, released))
        except BaseException as exc:
            errors.append(exc)

    first = lock(name, backend=alias, ttl=30).acquire()
    threads = []
    for i in range(count):
        thread = threading.Thread(target=waiter, args=(i,))
        thread.start()
        threads.append(thread)
        if fair:  # make arrival order certain: wait until this one is queued
            wait_for(lambda i=i: (backend.inspect(name).waiters or 0) >= i + 1, what="queued")
    release_at = time.monotonic()
    first.release()
    for thread in threads:
        thread.join(60)
    assert not errors
    events.insert(0, (-1, 0.0, release_at))
    return events


def test_every_release_wakes_a_waiter(waking_alias: str, name: str) -> None:
    events = _run_waiters(waking_alias, name, 16, fair=False)
    assert sorted(i for i, _, _ in events[1:]) == list(range(16))
    gaps = [nxt[1] - prev[2] for prev, nxt in itertools.pairwise(events)]
    # Each grant follows the previous release by far less than the 4 s timer.
    assert max(gaps) < 1.0, gaps
    assert all(gap >= 0 for gap in gaps)


def test_fair_waiters_are_served_in_arrival_order(waking_alias: str, name: str) -> None:
    events = _run_waiters(waking_alias, name, 16, fair=True)
    assert [i for i, _, _ in events[1:]] == list(range(16))
    gaps = [nxt[1] - prev[2] for prev, nxt in itertools.pairwise(events)]
    assert max(gaps) < 1.0, gaps


def test_a_fair_waiter_that_gives_up_does_not_block_the_next(waking_alias: str, name: str) -> None:
    backend = get_backend(waking_alias)
    holder = lock(name, backend=waking_alias, ttl=30).acquire()
    outcome: dict[str, object] = {}

    def impatient() -> None:
        try:
            # Long enough for the patient one to queue behind it on a loaded machine
            # (0.3 s: the impatient one had left before the patient one arrived).
            lock(name, backend=waking_alias, timeout=3, fair=True).acquire()
        except LockNotAcquired as exc:
            outcome["impatient"] = exc

    def patient() -> None:
        with lock(name, backend=waking_alias, timeout=20, fair=True):
            outcome["patient_at"] = time.monotonic()

    first = threading.Thread(target=impatient)
    first.start()
    wait_for(lambda: (backend.inspect(name).waiters or 0) >= 1, what="impatient queued")
    second = threading.Thread(target=patient)
    second.start()
    wait_for(lambda: (backend.inspect(name).waiters or 0) >= 2, what="patient queued")
    first.join(20)
    assert isinstance(outcome["impatient"], LockNotAcquired)
    released_at = time.monotonic()
    holder.release()
    second.join(20)
    assert float(outcome["patient_at"]) - released_at < 1.0  # type: ignore[arg-type]


def test_waiter_is_woken_by_expiry_of_a_dead_holder(alias: str, name: str) -> None:
    """No release ever comes: the wait is bounded by the holder's remaining lease."""
    if not get_backend(alias).expires_on_server:
        pytest.skip("this backend's locks do not expire on the server")
    lock(name, backend=alias, ttl=0.5, auto_renew=False).acquire()  # never released
    start = time.monotonic()
    with lock(name, backend=alias, timeout=10) as lease:
        waited = time.monotonic() - start
    assert lease.state == "released"
    # Woken by the expiry, not by the 10 s timeout. The margin covers servers that
    # round a lease up (etcd: whole seconds, expired leases swept every 500 ms) and a
    # loaded machine; a waiter that misses the expiry runs into its timeout instead.
    assert waited < 5.0


def test_waiters_are_counted_and_forgotten(shared_alias: str, name: str) -> None:
    backend = get_backend(shared_alias)
    holder = lock(name, backend=shared_alias, ttl=30).acquire()
    done = threading.Event()

    def give_up() -> None:
        with pytest.raises(LockNotAcquired):
            lock(name, backend=shared_alias, timeout=0.3).acquire()
        done.set()

    thread = threading.Thread(target=give_up)
    thread.start()
    wait_for(lambda: backend.inspect(name).waiters == 1, what="registered")
    assert done.wait(5)
    thread.join()
    assert backend.inspect(name).waiters == 0  # left the queue on the way out
    holder.release()


# -- reentrancy -------------------------------------------------------------------


def test_reentrant_lock_keeps_lease_and_token(alias: str, name: str) -> None:
    backend = get_backend(alias)
    with lock(name, backend=alias, reentrant=True) as outer:
        with lock(name, backend=alias, reentrant=True, timeout=0) as inner:
            assert inner is outer
            assert inner.fencing_token == outer.fencing_token
        assert outer.held()  # the inner exit did not release it
        info = backend.inspect(name)
        assert info is not None and info.owner == outer.owner
    assert outer.state == "released"
    assert backend.inspect(name) is None


def test_reentrancy_is_per_thread(alias: str, name: str) -> None:
    outcome: list[BaseException] = []

    def other_thread() -> None:
        try:
            lock(name, backend=alias, reentrant=True, timeout=0).acquire()
        except LockNotAcquired as exc:
            outcome.append(exc)

    with lock(name, backend=alias, reentrant=True):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert len(outcome) == 1


def test_non_reentrant_lock_blocks_its_own_thread(alias: str, name: str) -> None:
    with lock(name, backend=alias), pytest.raises(LockNotAcquired):
        lock(name, backend=alias, timeout=0).acquire()


def test_reentering_a_lost_lease_raises(alias: str, name: str) -> None:
    with pytest.raises(LockLost), lock(name, backend=alias, reentrant=True):
        get_backend(alias).force_release(name)
        with lock(name, backend=alias, reentrant=True):
            pytest.fail("re-entered a lost lease")


def test_reentrant_decorator_recursion(alias: str, name: str) -> None:
    tokens: list[int] = []

    @lock(name, backend=alias, reentrant=True, timeout=0)
    def recurse(n: int) -> None:
        from distlocks import reentrancy

        lease = reentrancy.current(alias, name)
        assert lease is not None
        tokens.append(lease.fencing_token)
        if n:
            recurse(n - 1)

    recurse(4)
    assert len(set(tokens)) == 1 and len(tokens) == 5
    assert get_backend(alias).inspect(name) is None


# -- release ----------------------------------------------------------------------


def test_retried_release_never_frees_a_newer_holder(alias: str, name: str) -> None:
    backend = get_backend(alias)
    first = lock(name, backend=alias).acquire()
    assert backend.release(name, first.owner) is True  # the reply "got lost"...
    second = lock(name, backend=alias, timeout=0).acquire()
    assert backend.release(name, first.owner) is False  # ...so the client retries
    info = backend.inspect(name)
    assert info is not None and info.owner == second.owner
    second.release()


def test_lock_many_releases_in_reverse_order(alias: str, name: str) -> None:
    order: list[str] = []

    def record(sender: object, lease: Lease, **kwargs: object) -> None:
        if lease.name.startswith(name):
            order.append(lease.name)

    lock_released.connect(record)
    try:
        with lock_many([f"{name}:b", f"{name}:a", f"{name}:c"], backend=alias):
            pass
    finally:
        lock_released.disconnect(record)
    assert order == [f"{name}:c", f"{name}:b", f"{name}:a"]


def test_a_dropped_lease_is_not_renewed_forever(alias: str, name: str) -> None:
    import gc

    lock(name, backend=alias, ttl=0.3).acquire()  # the lease object is dropped at once
    gc.collect()
    wait_for(lambda: get_backend(alias).inspect(name) is None, limit=5, what="expiry")
