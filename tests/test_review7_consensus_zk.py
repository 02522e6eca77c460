"""Review 7 of the ZooKeeper backend: restarts, elections and the loss of all data,
on real servers (Debian's jars, started here). Skipped, saying what to install, where
java or the ZooKeeper jars are missing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from distlocks import get_backend, lock
from distlocks.exceptions import LockLost
from distlocks.handler import backends
from distlocks.testing.zookeeper_server import ZooKeeperEnsemble, ZooKeeperServer, zookeeper_missing

pytestmark = pytest.mark.skipif(bool(zookeeper_missing()), reason=zookeeper_missing())

BACKEND = "distlocks.backends.zookeeper.ZooKeeperBackend"


@pytest.fixture
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    servers = ZooKeeperEnsemble(3).start()
    yield servers
    servers.close()


def restart_all(ensemble: ZooKeeperEnsemble, *, wipe: bool) -> None:
    """SIGKILL every server, optionally wipe its data (keeping its myid), start them
    all again and wait for a leader: a new election, so a new zxid epoch."""
    backends.reset()  # no client reconnecting into the restart
    for node in ensemble.nodes:
        node.kill()
    if wipe:
        for node in ensemble.nodes:
            data = node.base_dir / "data"
            myid = (data / "myid").read_text()
            shutil.rmtree(data)
            data.mkdir()
            (data / "myid").write_text(myid)
    for node in ensemble.nodes:
        node.start()
    ensemble.wait_for_quorum()


@pytest.mark.slow
def test_tokens_stay_above_after_elections_then_the_loss_of_all_data(
    settings: Any, ensemble: ZooKeeperEnsemble
) -> None:
    """Every election starts a new zxid epoch (the zxid jumps by 2**32). Tokens made
    from zxids ran ahead of the clock by 2**32 us (71 minutes) per election, so after
    two restarts of the ensemble and the loss of its data a few seconds later, the next
    token (from the clock) was below the ones issued before: a paused old holder's
    fenced writes would have been accepted. Tokens must not jump at elections."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zke": {"BACKEND": BACKEND, "LOCATION": ensemble.location,
                "OPTIONS": {"session_timeout": 4, "connect_timeout": 5}},
    }  # fmt: skip
    name = "review7:tokens"
    tokens = []
    for wipe in (False, False, True):
        for _ in range(2):
            with lock(name, backend="zke", ttl=4, timeout=30) as lease:
                tokens.append(lease.fencing_token)
        counter = get_backend("zke").fencing_counter(name)
        assert counter >= tokens[-1]
        restart_all(ensemble, wipe=wipe)
    with lock(name, backend="zke", ttl=4, timeout=30) as lease:
        tokens.append(lease.fencing_token)
    assert tokens == sorted(set(tokens)), tokens
    # Across restarts with the data kept, a token moves with the acquisitions, not by
    # 2**32 per election.
    assert tokens[4] - tokens[0] < 2**20, tokens


@pytest.fixture
def own_zk() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


def test_a_client_whose_server_came_back_with_no_data_connects_again(
    settings: Any, own_zk: ZooKeeperServer
) -> None:
    """The server is SIGKILLed and comes back on the same port with a fresh data
    directory while the client is idle. The server refuses a client that has seen a
    zxid above its own, and kazoo reconnects with the old session and its last zxid
    for ever: every later lock() failed with LockBackendUnavailable, and nothing but a
    restart of the process helped. The lease held across it is lost (loudly), and the
    next lock() gets a new session, the lock and a token above the old ones."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkf": {"BACKEND": BACKEND, "LOCATION": own_zk.location,
                "OPTIONS": {"session_timeout": 2, "connect_timeout": 1, "socket_timeout": 1}},
    }  # fmt: skip
    name = "review7:fresh"
    tokens = []
    for _ in range(3):
        with lock(name, backend="zkf", ttl=2, timeout=5) as lease:
            tokens.append(lease.fencing_token)
    held = lock(f"{name}:held", backend="zkf", ttl=2, timeout=5, auto_renew=False).acquire()
    port = own_zk.port
    own_zk.kill()
    shutil.rmtree(own_zk.base_dir / "data")
    own_zk.start(port=port)
    # Generous: the first calls may fail while the client finds out (a session
    # timeout), but the lock comes within the caller's timeout.
    with lock(name, backend="zkf", ttl=2, timeout=30) as lease:
        assert lease.fencing_token > max(tokens)
        assert lease.held()
    assert not held.held()
    with pytest.raises(LockLost):
        held.ensure_held()
    assert held.release() is False
    with lock(f"{name}:held", backend="zkf", ttl=2, timeout=0) as other:
        assert other.held()
