"""The ZooKeeper backend on a 3-server ensemble on loopback, through server faults.

Skipped, saying what to install, where java or the ZooKeeper jars are missing.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distlocks import get_backend, lock
from distlocks.exceptions import LockBackendUnavailable
from distlocks.testing.zookeeper_server import ZooKeeperEnsemble, zookeeper_missing
from tests import zookeeper_workers

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
