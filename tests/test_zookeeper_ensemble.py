"""The ZooKeeper backend on a 3-server ensemble on loopback, through server faults:
leaders killed while processes race, a holder through a leader change, a holder cut
off from every server while the leader goes (a proxy in front of each server), and an
acquisition made while no leader can be elected.

Skipped, saying what to install, where java or the ZooKeeper jars are missing.
"""

from __future__ import annotations

import contextlib
import itertools
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
from distlocks.exceptions import LockBackendUnavailable, LockLost
from distlocks.testing.zookeeper_server import ZooKeeperEnsemble, zookeeper_missing
from tests import zookeeper_workers
from tests.faults.proxy import FaultProxy

pytestmark = [
    pytest.mark.skipif(bool(zookeeper_missing()), reason=zookeeper_missing()),
    pytest.mark.slow,
]
BACKEND = "distlocks.backends.zookeeper.ZooKeeperBackend"


@pytest.fixture
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    servers = ZooKeeperEnsemble(3).start()
    yield servers
    servers.close()


def run_racers(
    ensemble: ZooKeeperEnsemble, name: str, folder: Path, seconds: float
) -> tuple[list[Any], Any]:
    """Start the racing processes; returns them and their barrier (which must live
    until they have started: a collected barrier cannot be unpickled by them)."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(3)
    procs = [
        ctx.Process(
            target=zookeeper_workers.race_through_faults,
            args=(ensemble.location, name, str(folder), seconds, start),
        )
        for _ in range(3)
    ]
    for proc in procs:
        proc.start()
    return procs, start


def check_history(folder: Path) -> list[int]:
    assert not (folder / "violations").exists(), (folder / "violations").read_text()
    tokens = [int(line) for line in (folder / "tokens").read_text().split()]
    # Appended while holding, so in the order the lock was held: strictly increasing.
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    return tokens


def tokens_so_far(folder: Path) -> int:
    path = folder / "tokens"
    return len(path.read_text().split()) if path.exists() else 0


def wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_leader_killed_and_restarted_while_processes_race(
    ensemble: ZooKeeperEnsemble, name: str, tmp_path: Path
) -> None:
    # The racers go on until told to stop (the stop file), so a loaded machine slows
    # the test down instead of cutting the race short; 240 s is only a backstop.
    procs, _barrier = run_racers(ensemble, name, tmp_path, seconds=240)
    try:
        wait_for(lambda: tokens_so_far(tmp_path) >= 50, timeout=90)
        leader = ensemble.leader()
        leader.kill()
        new_leader = ensemble.wait_for_quorum()
        assert new_leader is not leader
        before = tokens_so_far(tmp_path)
        wait_for(lambda: tokens_so_far(tmp_path) >= before + 50, timeout=90)
        leader.start()
        ensemble.wait_for_quorum()
        # The second leader goes too: the restarted one has to have caught up.
        ensemble.leader().kill()
        ensemble.wait_for_quorum()
        before = tokens_so_far(tmp_path)
        wait_for(lambda: tokens_so_far(tmp_path) >= before + 50, timeout=90)
    finally:
        (tmp_path / "stop").touch()
        for proc in procs:
            proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    tokens = check_history(tmp_path)
    assert len(tokens) >= 150


def test_a_holder_keeps_its_lock_through_a_leader_change(
    settings: Any, ensemble: ZooKeeperEnsemble, name: str
) -> None:
    """A session outlives a leader change: the holder's node, lease and token stay."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zke": {"BACKEND": BACKEND, "LOCATION": ensemble.location,
                "OPTIONS": {"session_timeout": 6, "connect_timeout": 1}},
    }  # fmt: skip
    lease = lock(name, backend="zke", ttl=6, timeout=1).acquire()
    ensemble.leader().kill()
    ensemble.wait_for_quorum()
    # Held throughout: renewals (every 2 s) reconnect to a surviving server.
    for _ in range(25):
        assert lease.held()
        time.sleep(0.2)
    backend = get_backend("zke")

    def info_token() -> int | None:
        try:
            info = backend.inspect(name)
        except LockBackendUnavailable:
            return None
        return info.fencing_token if info else -1

    wait_for(lambda: info_token() is not None, timeout=10)
    assert info_token() == lease.fencing_token
    blocked = threading.Event()

    def contender() -> None:
        with lock(name, backend="zke", ttl=6, timeout=10) as other:
            assert other.fencing_token > lease.fencing_token
            blocked.set()

    thread = threading.Thread(target=contender)
    thread.start()
    time.sleep(0.3)
    assert not blocked.is_set()
    lease.release()
    thread.join(10)
    assert blocked.is_set()


def zk_alias(settings: Any, alias: str, location: str, **options: Any) -> str:
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        alias: {"BACKEND": BACKEND, "LOCATION": location, "OPTIONS": options},
    }
    return alias


def connected(alias: str) -> bool:
    """Whether the backend answers (its client is connected again)."""
    try:
        get_backend(alias).contenders("-")
    except LockBackendUnavailable:
        return False
    return True


@pytest.fixture
def proxies(ensemble: ZooKeeperEnsemble) -> Iterator[list[FaultProxy]]:
    """A proxy in front of each server of the ensemble, to cut a client off."""
    from distlocks.handler import backends

    started = [FaultProxy(node.port).start() for node in ensemble.nodes]
    yield started
    # Clients first: one left reconnecting through a closing proxy leaves it
    # coroutines that never end.
    backends.reset()
    for proxy in started:
        proxy.close()


def test_a_holder_cut_off_while_the_leader_goes_leaves_no_node_behind(
    settings: Any, ensemble: ZooKeeperEnsemble, proxies: list[FaultProxy], name: str
) -> None:
    """The holder is cut off from every server while the leader goes. Renewing, it
    cannot tell whether its session lives: it declares the lease lost once the
    session may have expired, and does not release it. The session lives on (the cut
    ends in time, and the new leader gives every session a full timeout), and so
    would its node, blocking the lock for as long as the process lives; it is deleted
    once the holder is back, and another client gets the lock."""
    session_timeout = 9
    holder = zk_alias(
        settings, "zkh", ",".join(f"127.0.0.1:{proxy.port}" for proxy in proxies),
        session_timeout=session_timeout, connect_timeout=0.3, socket_timeout=0.3,
    )  # fmt: skip
    other = zk_alias(settings, "zko", ensemble.location, session_timeout=session_timeout)
    # A ttl longer than the session (as with the default ttl): the renewal, not the
    # local deadline, finds the lease lost. Renewed below by hand, as the renewer
    # would (which might renew just before the cut on a loaded machine).
    ttl = 3 * session_timeout
    lease = lock(name, backend=holder, ttl=ttl, timeout=10, auto_renew=False).acquire()
    session = get_backend(holder).session_id()
    # Only kazoo's pings for 2/3 of the session: the renewal cannot trust them.
    quiet_until = time.monotonic() + session_timeout * 2 / 3 + 0.5
    wait_for(lambda: time.monotonic() >= quiet_until, timeout=10)
    for proxy in proxies:
        proxy.drop()
        proxy.reset()
    ensemble.leader().kill()

    def renewal_gives_up() -> bool:
        try:
            lease.extend()
        except LockBackendUnavailable:
            return False  # not yet: tried again, as the renewer does
        except LockLost:
            return True
        raise AssertionError("renewed while cut off")

    wait_for(renewal_gives_up, timeout=30)
    for proxy in proxies:
        proxy.heal()
    # Found lost by the renewal, or by its local deadline, which is never later than the
    # granted session whatever the ttl (the extend that found it gave it back, as the
    # renewer does, which could not reach the ensemble: left to the background delete).
    assert "no longer had it" in lease.lost_reason or "ran out" in lease.lost_reason
    ensemble.wait_for_quorum()
    wait_for(lambda: connected(holder), timeout=30)
    # The scenario of this test: the holder's session outlived the cut.
    assert get_backend(holder).session_id() == session
    # Not released by its holder (as a renewal that finds the lease lost does not).
    with lock(name, backend=other, ttl=ttl, timeout=30) as after:
        assert after.fencing_token > lease.fencing_token
    assert lease.owner not in get_backend(other).contenders(name)
    assert not lease.release()


def test_an_acquire_waits_out_an_election(
    settings: Any, ensemble: ZooKeeperEnsemble, name: str
) -> None:
    """The leader dies and one of the two others is paused: no leader can be elected
    until it resumes. An acquire with a timeout made meanwhile waits it out, instead
    of failing at its first attempt, and leaves one node."""
    alias = zk_alias(settings, "zke", ensemble.location, session_timeout=6, connect_timeout=1,
                     socket_timeout=1)  # fmt: skip
    backend = get_backend(alias)
    with lock(name, backend=alias, ttl=6, timeout=10):
        pass
    leader = ensemble.leader()
    paused = next(node for node in ensemble.nodes if node is not leader)
    leader.kill()
    assert paused.pid
    os.kill(paused.pid, signal.SIGSTOP)
    outcome: list[Any] = []

    def acquire() -> None:
        try:
            outcome.append(lock(name, backend=alias, ttl=6, timeout=60).acquire())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=acquire)
    try:
        thread.start()
        # Longer than a few attempts (each waits connect_timeout for a connection).
        resume_at = time.monotonic() + 4
        wait_for(lambda: bool(outcome) or time.monotonic() >= resume_at, timeout=10)
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    thread.join(90)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    lease = outcome[0]
    assert lease.held()
    assert backend.contenders(name) == [lease.owner]
    lease.release()


@pytest.mark.parametrize("release_during_election", [False, True])
def test_a_hand_off_across_a_leader_change(
    settings: Any, ensemble: ZooKeeperEnsemble, name: str, release_during_election: bool
) -> None:
    """A waiter queued just behind the holder (its watch set) when the leader dies: the
    servers drop their clients during the election, so the waiter's watch ends with
    no event and it looks again once reconnected, in the same session. The holder
    releases after the new leader is in place (or tries during the election, the
    release then left to the background delete): the waiter gets the lock, first on
    the server, with a higher token, and no node is left."""
    holding = zk_alias(settings, "zkh", ensemble.location, session_timeout=9,
                       connect_timeout=1, socket_timeout=1)  # fmt: skip
    waiting = zk_alias(settings, "zkw", ensemble.location, session_timeout=9)
    lease = lock(name, backend=holding, ttl=9, timeout=5, auto_renew=False).acquire()
    holder_path = get_backend(holding)._nodes[(name, lease.owner)].path
    backend = get_backend(waiting)
    got: list[Any] = []

    def waiter() -> None:
        try:
            other = lock(name, backend=waiting, ttl=9, timeout=60, auto_renew=False).acquire()
            first = get_backend(waiting).contenders(name)[:1] == [other.owner]
            got.append((other, first))
        except Exception as exc:
            got.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    client = backend._ready("test", name)
    wait_for(lambda: len(client._data_watchers.get(holder_path, ())) >= 1, timeout=20)
    session = backend.session_id()
    ensemble.leader().kill()
    if release_during_election:
        # Deleted in the background once the ensemble answers, if it cannot now.
        with contextlib.suppress(LockBackendUnavailable):
            lease.release()
    ensemble.wait_for_quorum()
    if not release_during_election:
        wait_for(lambda: connected(holding), timeout=30)
        time.sleep(0.3)
        assert not got  # still waiting
        lease.release()
    thread.join(60)
    assert len(got) == 1 and not isinstance(got[0], Exception), got
    other, first = got[0]
    assert first
    assert other.fencing_token > lease.fencing_token
    assert backend.session_id() == session  # the waiter's session outlived the election
    assert backend.contenders(name) == [other.owner]
    other.release()
    assert backend.contenders(name) == []
