"""Semaphores and read-write locks on etcd: what is particular to it (the contract runs
in tests/test_semaphore.py and tests/test_rwlock.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from distlocks import rwlock, semaphore
from distlocks.backends.base import Holder
from distlocks.backends.etcd import EtcdBackend
from distlocks.backends.etcd.permit_rules import MAX_WATCHED
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.testing.etcd_server import EtcdServer, etcd_missing
from tests import test_command
from tests.test_semaphore import hold_permit_until_killed
from tests.waiting import wait_for, wait_for_text, wait_gone

pytestmark = pytest.mark.skipif(bool(etcd_missing()), reason=f"no etcd: {etcd_missing()}")

HOLDER = Holder("test-host", os.getpid(), "main")


@pytest.fixture
def etcd(etcd_ready: str) -> EtcdBackend:
    return client("etcd")


def client(alias: str) -> EtcdBackend:
    """A client of its own (connections, leases) on the tests' etcd: another caller."""
    return EtcdBackend(alias, settings.DISTLOCKS_BACKENDS["etcd"])


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.close()


def requests_served(server: EtcdServer) -> int:
    from tests.test_etcd import requests_served as served

    return served(server)


def test_clients_racing_for_the_last_permit_one_wins(etcd: EtcdBackend, name: str) -> None:
    held = [etcd.permit_acquire("semaphore", name, f"h{i}", 10, HOLDER, limit=3) for i in range(2)]
    assert all(r.acquired for r in held)
    clients = [client(f"racer{i}") for i in range(6)]
    for round_ in range(5):
        start = threading.Barrier(len(clients))
        results: list[Any] = [None] * len(clients)

        def race(
            i: int,
            round_: int = round_,
            start: threading.Barrier = start,
            results: list[Any] = results,
        ) -> None:
            start.wait(30)
            results[i] = clients[i].permit_acquire(
                "semaphore", name, f"r{round_}-{i}", 10, HOLDER, limit=3
            )

        threads = [threading.Thread(target=race, args=(i,)) for i in range(len(clients))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        winners = [i for i, result in enumerate(results) if result.acquired]
        assert len(winners) == 1, results
        # The losers wrote nothing: only the three holders are queued.
        assert len(etcd.permit_queue("semaphore", name)) == 3
        assert clients[winners[0]].permit_release("semaphore", name, f"r{round_}-{winners[0]}")
    for i in range(2):
        etcd.permit_release("semaphore", name, f"h{i}")


def test_an_expired_holder_lets_the_waiters_in(etcd: EtcdBackend, name: str) -> None:
    rw = rwlock(name, backend="etcd")
    stale = rw.write(ttl=0.5, auto_renew=False).acquire()
    got: list[tuple[str, float]] = []
    began = time.monotonic()

    def enter(kind: str) -> None:
        with getattr(rw, kind)(ttl=10, timeout=30):
            got.append((kind, time.monotonic() - began))

    waiters = [threading.Thread(target=enter, args=(kind,)) for kind in ("read", "read")]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(60)
    # Let in by the lease's end (the server's shortest lease is 1 s here), not polling.
    assert [kind for kind, _ in got] == ["read", "read"]
    assert all(after < 15 for _, after in got)
    assert stale.release() is False and stale.state == "lost"
    assert rw.holders() == []


def test_a_stopped_holders_permit_goes_to_the_waiter(
    etcd: EtcdBackend, name: str, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    proc = multiprocessing.get_context("spawn").Process(
        target=hold_permit_until_killed, args=("etcd", name, 1.0, str(ready))
    )
    proc.start()
    try:
        owner = wait_for_text(ready, 60, "the holder")
        sem = semaphore(name, limit=1, backend="etcd", ttl=10)
        assert [h.owner for h in sem.holders()] == [owner]
        os.kill(proc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        lease = sem.acquire(timeout=30)
        assert [h.owner for h in sem.holders()] == [lease.owner]
        lease.release()
        os.kill(proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
        # Resumed, it has no permit any more (its renewal finds the key gone).
        assert owner not in [h.owner for h in sem.holders()]
    finally:
        proc.kill()
        wait_gone([proc.pid])  # type: ignore[list-item]
        proc.join(10)


def test_a_waiter_whose_lease_ran_out_is_granted_only_on_a_live_one(
    etcd: EtcdBackend, name: str
) -> None:
    assert etcd.permit_acquire("write", name, "holder", 10, HOLDER).acquired
    assert not etcd.permit_acquire("write", name, "waiter", 10, HOLDER, wait=10).acquired
    queued = etcd._permit_table()[("write", name, "waiter")]
    dead = queued.lease
    for lease in queued.leases():  # its leases ran out while it was paused
        etcd._revoke_quietly(lease)
    assert etcd.permit_queue("write", name) == [("write", "holder")]
    assert etcd.permit_release("write", name, "holder")
    result = etcd.permit_acquire("write", name, "waiter", 10, HOLDER, wait=10)
    assert result.acquired and result.fencing_token == etcd.permit_counter(name)
    [info] = etcd.permit_holders("rwlock", name)
    lease = int(info.extra["lease"], 16)
    assert lease != dead and etcd._time_to_live(lease, "inspect", name)[0] > 0
    assert etcd.permit_release("write", name, "waiter")


def test_force_release_while_the_holder_renews(etcd: EtcdBackend, name: str) -> None:
    renewer = client("renewer")
    assert renewer.permit_acquire("write", name, "victim", 5, HOLDER).acquired
    token = renewer.permit_counter(name)
    evicted = threading.Event()
    after: list[bool] = []
    stop = threading.Event()

    def renew() -> None:
        while not stop.is_set():
            looked = evicted.is_set()
            ok = renewer.permit_extend("write", name, "victim", 5)
            if looked:
                after.append(ok)  # begun after the eviction returned
            if looked and not ok:
                return

    thread = threading.Thread(target=renew)
    thread.start()
    try:
        time.sleep(0.2)  # some renewals go through first
        [info] = etcd.permit_holders("rwlock", name)
        assert etcd.force_release_holder(info) is True
        evicted.set()
        thread.join(30)
    finally:
        stop.set()
        thread.join(30)
    assert after == [False]  # no renewal succeeded once the eviction was done
    assert etcd.permit_counter(name) > token
    assert etcd.force_release_holder(info) is False  # bound to the holder shown
    assert etcd.permit_acquire("write", name, "next", 5, HOLDER).acquired
    assert etcd.permit_counter(name) > token
    assert etcd.force_release_holder(info) is False  # the new holder is left alone
    assert etcd.permit_release("write", name, "next")


def test_a_writer_gets_in_while_readers_keep_arriving(etcd: EtcdBackend, name: str) -> None:
    rw = rwlock(name, backend="etcd")
    stop = threading.Event()
    reads = [0]

    def read_forever() -> None:
        while not stop.is_set():
            with rw.read(ttl=10, timeout=60):
                reads[0] += 1
                time.sleep(0.05)

    readers = [threading.Thread(target=read_forever) for _ in range(4)]
    for thread in readers:
        thread.start()
    try:
        wait_for(lambda: reads[0] >= 8, 30, "readers overlapping")
        began = time.monotonic()
        with rw.write(ttl=10, timeout=30) as writer:
            waited = time.monotonic() - began
            assert [h.owner for h in rw.holders()] == [writer.owner]
    finally:
        stop.set()
        for thread in readers:
            thread.join(60)
    assert waited < 30


def test_each_request_is_judged_by_its_own_limit(etcd: EtcdBackend, name: str) -> None:
    # As on ZooKeeper: a request holds when fewer than its own limit are ahead of it.
    two = [semaphore(name, limit=2, backend="etcd", ttl=10).acquire() for _ in range(2)]
    try:
        with pytest.raises(LockNotAcquired):
            semaphore(name, limit=1, backend="etcd", timeout=0).acquire()
        with semaphore(name, limit=3, backend="etcd", ttl=10, timeout=0) as third:
            limits = {h.owner: h.extra["limit"] for h in third_holders(name)}
            assert limits == {two[0].owner: 2, two[1].owner: 2, third.owner: 3}
    finally:
        for lease in two:
            lease.release()


def third_holders(name: str) -> list[Any]:
    return semaphore(name, limit=1, backend="etcd").holders()


@pytest.mark.parametrize(
    "suffix",
    ["a/b", "a%2Fb", "../..", "w/x", "r/", "sem/x", " ünï 😀\\ ", "x" * 200, "😀" * 200],
    ids=["slash", "percent", "dots", "w-slash", "r-slash", "sem", "unicode", "long", "long-4-byte"],
)
def test_strange_names_stay_apart(etcd: EtcdBackend, suffix: str) -> None:
    names = [suffix, suffix[:-1] or "z", f"{suffix[:150]}/w"]
    leases = []
    try:
        for each in names:
            leases.append(semaphore(each, limit=1, backend="etcd", ttl=10, timeout=0).acquire())
            leases.append(rwlock(each, backend="etcd").write(ttl=10, timeout=0).acquire())
        listed = {(i.name, i.extra["kind"], i.owner) for i in etcd.iter_permits()}
        for each, (sem, write) in zip(
            names, zip(leases[::2], leases[1::2], strict=True), strict=True
        ):
            assert (each, "semaphore", sem.owner) in listed
            assert (each, "write", write.owner) in listed
            assert write.fencing_token == rwlock(each, backend="etcd").fencing_counter() > 0
    finally:
        for lease in leases:
            lease.release()


def test_a_waiter_does_not_poll(own_etcd: EtcdServer, name: str) -> None:
    backend = EtcdBackend("own", {"LOCATION": own_etcd.location})
    assert backend.permit_acquire("semaphore", name, "holder", 10, HOLDER, limit=1).acquired
    assert not backend.permit_acquire("semaphore", name, "w", 10, HOLDER, limit=1, wait=10).acquired
    released: list[float] = []

    def release_later() -> None:
        time.sleep(1.5)
        released.append(time.monotonic())
        client_ = EtcdBackend("own2", {"LOCATION": own_etcd.location})
        assert client_.permit_release("semaphore", name, "holder")

    before = requests_served(own_etcd)
    thread = threading.Thread(target=release_later)
    thread.start()
    backend.permit_wait("semaphore", name, 30, owner="w", limit=1)
    woke = time.monotonic()
    thread.join(30)
    # The queue read, the watch, the release's few calls; no polling for 1.5 s.
    assert requests_served(own_etcd) - before < 15
    assert released and woke - released[0] < 5
    assert backend.permit_acquire("semaphore", name, "w", 10, HOLDER, limit=1, wait=10).acquired


def test_a_large_limit_watches_the_name(etcd: EtcdBackend, name: str) -> None:
    limit = MAX_WATCHED + 2
    for i in range(limit):
        assert etcd.permit_acquire("semaphore", name, f"h{i}", 10, HOLDER, limit=limit).acquired
    waiter = client("waiter")
    assert not waiter.permit_acquire(
        "semaphore", name, "w", 10, HOLDER, limit=limit, wait=10
    ).acquired
    threading.Timer(0.3, etcd.permit_release, args=("semaphore", name, "h5")).start()
    began = time.monotonic()
    waiter.permit_wait("semaphore", name, 30, owner="w", limit=limit)
    assert time.monotonic() - began < 15
    assert waiter.permit_acquire("semaphore", name, "w", 10, HOLDER, limit=limit, wait=10).acquired
    assert etcd.permit_force_release("semaphore", name) == limit


def test_renewal_is_loud_when_the_permit_is_gone(etcd_ready: str, name: str) -> None:
    lost = threading.Event()
    rw = rwlock(name, backend="etcd")
    with pytest.raises(LockLost):
        with rw.read(ttl=1, on_lost=lambda _: lost.set()) as lease:
            wait_for(lambda: lease.renewals >= 1, 30, "a renewal")
            client("admin").permit_force_release("read", name)
            assert lost.wait(30)


@pytest.mark.django_db
def test_the_command_lists_inspects_and_releases_etcd_permits(etcd_ready: str, name: str) -> None:
    test_command.test_inspect_and_release_one_permit(name, "etcd", None)
