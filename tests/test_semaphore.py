"""semaphore(): at most ``limit`` holders, each permit with its own lease."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from distlocks import asemaphore, get_backend, rwlock, semaphore
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.lease import AsyncLease, Lease
from tests import workers
from tests.conftest import PERMIT_BACKENDS, alias_fixture
from tests.waiting import wait_for, wait_for_text, wait_gone

alias = alias_fixture("alias", PERMIT_BACKENDS, "Each backend with semaphores in turn.")
shared_alias = alias_fixture(
    "shared_alias",
    [a for a in PERMIT_BACKENDS if a != "locmem"],
    "Each backend whose semaphores processes share.",
)


# -- code run in worker processes (spawned: they import this module) -----------------


def hold_permits(
    alias: str, name: str, limit: int, rounds: int, hold: float, out: str, start: Any
) -> None:
    """Take a permit ``rounds`` times, holding it ``hold`` s; record when it was held
    (monotonic times, taken inside the permit: comparable across processes)."""
    workers.setup_django()
    from distlocks import semaphore

    start.wait(120)
    spans = []
    for _ in range(rounds):
        with semaphore(name, limit=limit, backend=alias, ttl=10, timeout=120):
            entered = time.monotonic()
            time.sleep(hold)  # the work done under the permit
            spans.append((entered, time.monotonic()))
    Path(out).write_text(json.dumps(spans))


def hold_permit_until_killed(alias: str, name: str, ttl: float, ready: str) -> None:
    workers.setup_django()
    from distlocks import semaphore

    lease = semaphore(name, limit=1, backend=alias, ttl=ttl, timeout=10).acquire()
    Path(ready).write_text(lease.owner)
    while True:
        time.sleep(0.1)


def fork_workers(target: Any, arg_lists: list[tuple[Any, ...]]) -> None:
    """Run ``target(*args, start)`` in one forked process per ``args``, all released
    together by the barrier ``start``; exit 1 unless every one exited cleanly.

    This runs in a spawned process that has set Django up and has no thread but its
    own: forking from it is safe (forking the test process, with its renewal and
    worker threads, is not), and much faster than spawning every worker.
    """
    workers.setup_django()
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(len(arg_lists))
    procs = [ctx.Process(target=target, args=(*args, start)) for args in arg_lists]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(150)
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    if codes != [0] * len(procs):
        raise SystemExit(f"workers exited with {codes}")


def run_forked(target: Any, arg_lists: list[tuple[Any, ...]]) -> None:
    """:func:`fork_workers` from a fresh (spawned) launcher process."""
    launcher = multiprocessing.get_context("spawn").Process(
        target=fork_workers, args=(target, arg_lists)
    )
    launcher.start()
    launcher.join(180)
    if launcher.exitcode is None:
        launcher.kill()
    assert launcher.exitcode == 0, f"the workers' launcher exited with {launcher.exitcode}"


# -- helpers ----------------------------------------------------------------------------


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of intervals that overlap at one instant."""
    # At equal times an exit comes before an entry: touching is not overlapping.
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    inside = most = 0
    for _, step in events:
        inside += step
        most = max(most, inside)
    return most


def test_most_at_once() -> None:
    assert most_at_once([(0, 1), (1, 2)]) == 1
    assert most_at_once([(0, 3), (1, 2), (1.5, 4), (5, 6)]) == 3


# -- the contract, on every backend -------------------------------------------------------


def test_limit_holders_at_once_then_refused(alias: str, name: str) -> None:
    sem = semaphore(name, limit=3, backend=alias, ttl=10)
    leases = [sem.acquire(timeout=0) for _ in range(3)]
    try:
        assert all(isinstance(lease, Lease) and lease.held() for lease in leases)
        assert len({lease.owner for lease in leases}) == 3
        with pytest.raises(LockNotAcquired) as excinfo:
            sem.acquire(timeout=0)
        assert "all 3 permits were held" in str(excinfo.value)
        assert "tried once" in str(excinfo.value)
        holders = sem.holders()
        assert sorted(h.owner for h in holders) == sorted(lease.owner for lease in leases)
        assert {h.extra["kind"] for h in holders} == {"semaphore"}
        assert {h.extra["limit"] for h in holders} == {3}
        assert all(lease.kind == "semaphore" and lease.fencing_token == 0 for lease in leases)
    finally:
        for lease in leases:
            lease.release()
    assert sem.holders() == []


def test_a_release_lets_a_waiter_in(alias: str, name: str) -> None:
    first = semaphore(name, limit=1, backend=alias, ttl=10).acquire()
    released_at: list[float] = []

    def release_soon() -> None:
        time.sleep(0.2)
        released_at.append(time.monotonic())
        first.release()

    thread = threading.Thread(target=release_soon)
    thread.start()
    second = semaphore(name, limit=1, backend=alias, ttl=10, timeout=10).acquire()
    granted_at = time.monotonic()
    thread.join()
    try:
        assert released_at and granted_at >= released_at[0]
    finally:
        second.release()


def test_timeout_runs_out(alias: str, name: str) -> None:
    with semaphore(name, limit=1, backend=alias, ttl=10):
        start = time.monotonic()
        with pytest.raises(LockNotAcquired, match=r"throughout the 0\.3s wait"):
            semaphore(name, limit=1, backend=alias, timeout=0.3).acquire()
        assert time.monotonic() - start >= 0.3


def test_release_gives_back_only_ones_own_permit(alias: str, name: str) -> None:
    sem = semaphore(name, limit=2, backend=alias, ttl=10)
    mine, theirs = sem.acquire(), sem.acquire()
    try:
        assert mine.release() is True
        assert mine.release() is False  # idempotent
        assert [h.owner for h in sem.holders()] == [theirs.owner]
        assert theirs.held()
    finally:
        theirs.release()


def test_an_ended_permit_never_frees_the_next_holders(alias: str, name: str) -> None:
    backend = get_backend(alias)
    stale = semaphore(name, limit=1, backend=alias, ttl=0.3, auto_renew=False).acquire()
    if backend.expires_on_server:
        wait_for(lambda: semaphore(name, limit=1, backend=alias).holders() == [], 10)
    else:  # held until its session ends: end it
        assert backend.permit_force_release("semaphore", name, stale.owner) == 1
    fresh = semaphore(name, limit=1, backend=alias, ttl=10, timeout=0).acquire()
    try:
        assert stale.release() is False
        assert stale.state == "lost"
        assert [h.owner for h in semaphore(name, limit=1, backend=alias).holders()] == [fresh.owner]
    finally:
        fresh.release()


def test_each_acquisition_is_judged_by_its_own_limit(alias: str, name: str) -> None:
    with semaphore(name, limit=1, backend=alias, ttl=10):
        with pytest.raises(LockNotAcquired):
            semaphore(name, limit=1, backend=alias, timeout=0).acquire()
        with semaphore(name, limit=2, backend=alias, ttl=10, timeout=0) as wider:
            assert wider.held()


def test_renewal_keeps_a_permit_and_a_lost_one_is_loud(alias: str, name: str) -> None:
    lost = threading.Event()
    sem = semaphore(name, limit=2, backend=alias, ttl=1.5, on_lost=lambda _: lost.set())
    with pytest.raises(LockLost) as excinfo:
        with sem as lease:
            wait_for(lambda: lease.renewals >= 2, what="two renewals")
            assert lease.held()
            assert get_backend(alias).permit_force_release("semaphore", name, lease.owner) == 1
            assert lost.wait(10), "the loss was not noticed"
    assert excinfo.value.lease is lease
    assert "renewal" in excinfo.value.reason


def test_decorator_admits_at_most_limit(alias: str, name: str) -> None:
    inside = most = 0
    guard = threading.Lock()

    @semaphore(name, limit=2, backend=alias, ttl=10, timeout=30)
    def work() -> None:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.02)
        with guard:
            inside -= 1

    threads = [threading.Thread(target=lambda: [work() for _ in range(3)]) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == 2


def test_asyncio_form(alias: str, name: str) -> None:
    async def main() -> None:
        sem = asemaphore(name, limit=2, backend=alias, ttl=10)
        async with sem as first, sem as second:
            assert isinstance(first, AsyncLease) and first.held() and second.held()
            with pytest.raises(LockNotAcquired):
                await sem.acquire(timeout=0)
        assert first.state == second.state == "released"
        inside = most = 0

        @asemaphore(name, limit=2, backend=alias, ttl=10, timeout=30)
        async def work() -> None:
            nonlocal inside, most
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1

        await asyncio.gather(*(work() for _ in range(6)))
        assert most == 2

    asyncio.run(asyncio.wait_for(main(), 60))


def test_listed_and_force_released_through_iter_locks(alias: str, name: str) -> None:
    backend = get_backend(alias)
    lease = semaphore(name, limit=3, backend=alias, ttl=10).acquire()
    try:
        mine = [info for info in backend.iter_locks() if info.owner == lease.owner]
        assert len(mine) == 1
        info = mine[0]
        assert info.name == name
        assert info.extra["kind"] == "semaphore" and info.extra["limit"] == 3
        assert info.pid == os.getpid()
        assert backend.force_release_holder(info) is True
        assert backend.force_release_holder(info) is False
        with pytest.raises(LockLost):
            lease.extend()
    finally:
        lease.release()


def test_a_plain_lock_of_the_same_name_is_another_thing(alias: str, name: str) -> None:
    from distlocks import lock

    with lock(name, backend=alias, ttl=10), semaphore(name, limit=1, backend=alias, timeout=0):
        assert get_backend(alias).inspect(name) is not None


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        (0, ValueError, "at least 1"),
        (-2, ValueError, "at least 1"),
        (1.5, TypeError, "must be an int"),
        ("3", TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
        (None, TypeError, "must be an int"),
    ],
)
def test_bad_limit_is_refused_at_the_call(limit: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        semaphore("x", limit=limit, backend="locmem")


def test_bad_lock_arguments_are_refused_at_the_call() -> None:
    with pytest.raises(ValueError, match="ttl"):
        semaphore("x", limit=2, backend="locmem", ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        semaphore("x", limit=2, backend="locmem", timeout=-1)
    with pytest.raises(ValueError, match="empty"):
        semaphore("", limit=2, backend="locmem")
    with pytest.raises(ImproperlyConfigured, match="Unknown distlocks backend alias"):
        semaphore("x", limit=2, backend="nope")
    with pytest.raises(TypeError, match="asemaphore"):

        @semaphore("x", limit=2, backend="locmem")
        async def not_for_sync() -> None: ...


@pytest.mark.django_db
@pytest.mark.parametrize("other", ["pgx", "redlock"])
def test_other_backends_say_so(other: str) -> None:
    # Transaction-mode PostgreSQL locks end with the transaction: no permits there.
    # Redlock (a quorum of servers) has none either.
    if other not in settings.DISTLOCKS_BACKENDS:
        pytest.skip(f"no {other!r} backend configured")
    with pytest.raises(ImproperlyConfigured, match=rf"'{other}'.*does not support semaphores"):
        semaphore("x", limit=2, backend=other)
    with pytest.raises(ImproperlyConfigured, match="does not support read-write locks"):
        rwlock("x", backend=other)


# -- between processes -------------------------------------------------------------------

PROCESSES = 20
LIMIT = 3


@pytest.mark.slow
def test_processes_never_exceed_the_limit(shared_alias: str, name: str, tmp_path: Path) -> None:
    outs = [tmp_path / f"spans-{i}.json" for i in range(PROCESSES)]
    run_forked(hold_permits, [(shared_alias, name, LIMIT, 2, 0.1, str(out)) for out in outs])
    spans = [tuple(span) for out in outs for span in json.loads(out.read_text())]
    assert len(spans) == PROCESSES * 2
    # Never more than the limit inside, and the limit was reached (so this could fail).
    assert most_at_once(spans) == LIMIT  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_killed_holders_permit_comes_back(shared_alias: str, name: str, tmp_path: Path) -> None:
    backend = get_backend(shared_alias)
    ttl = 3.0 if backend.expires_on_server else 60.0
    ready = tmp_path / "ready"
    proc = multiprocessing.get_context("spawn").Process(
        target=hold_permit_until_killed, args=(shared_alias, name, ttl, str(ready))
    )
    proc.start()
    try:
        owner = wait_for_text(ready, 60, "the holder")
        sem = semaphore(name, limit=1, backend=shared_alias, ttl=10)
        assert [h.owner for h in sem.holders()] == [owner]
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed_at = time.monotonic()
        assert wait_gone([proc.pid]) == []  # type: ignore[list-item]
        if backend.expires_on_server:
            # Redis: the dead holder's permit stays until its lease runs out...
            assert [h.owner for h in sem.holders()] == [owner]
        # ...then it comes back (at once on PostgreSQL: the session ended with it).
        # (The waits allow for a loaded machine; PostgreSQL's ttl is far beyond its wait.)
        lease = sem.acquire(timeout=ttl + 10 if backend.expires_on_server else 10)
        back_after = time.monotonic() - killed_at
        lease.release()
        if not backend.expires_on_server:
            assert back_after < ttl
    finally:
        proc.kill()
        proc.join(10)
