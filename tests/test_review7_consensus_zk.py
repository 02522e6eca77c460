"""Review 7 of the ZooKeeper backend: restarts, elections and the loss of all data,
on real servers (Debian's jars, started here). Skipped, saying what to install, where
java or the ZooKeeper jars are missing."""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from distlocks import get_backend, lock
from distlocks.exceptions import LockLost, LockNotAcquired
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


@pytest.fixture(scope="module")
def shared_zk() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


@hypothesis.settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    plans=st.lists(
        st.lists(st.sampled_from(["wait", "try", "force"]), min_size=1, max_size=6),
        min_size=2,
        max_size=4,
    )
)
def test_sessions_racing_through_the_listed_version_keep_tokens_in_grant_order(
    settings: Any, shared_zk: ZooKeeperServer, plans: list[list[str]]
) -> None:
    """Sessions race on one name, each queueing through the fence node's listed
    version (a raced write lists again): never two holders at once, every grant's
    token above every earlier grant's, the listing shows the holder's own token, and
    a force release bound to a token seen evicts only that holder."""
    aliases = [f"zkr{i}" for i in range(len(plans))]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        **{alias: {"BACKEND": BACKEND, "LOCATION": shared_zk.location,
                   "OPTIONS": {"session_timeout": 10}} for alias in aliases},
    }  # fmt: skip
    name = f"review7:race:{uuid.uuid4().hex[:8]}"
    guard = threading.Lock()
    inside: list[str] = []
    grants: list[int] = []
    problems: list[str] = []

    def run(alias: str, plan: list[str]) -> None:
        backend = get_backend(alias)
        for step in plan:
            try:
                if step == "force":
                    info = backend.inspect(name)
                    # Under the guard: the evicted holder is out from the moment of
                    # the eviction, though its block has not ended yet.
                    with guard:
                        if info is not None and backend.force_release(name, info.fencing_token):
                            inside.clear()
                    continue
                timeout = 30 if step == "wait" else 0
                with lock(name, backend=alias, ttl=10, timeout=timeout, auto_renew=False) as lease:
                    with guard:
                        if inside:
                            problems.append(f"{alias} entered while {inside} held")
                        if grants and lease.fencing_token <= grants[-1]:
                            problems.append(f"token {lease.fencing_token} after {grants[-1]}")
                        inside.append(alias)
                        grants.append(lease.fencing_token)
                    info = backend.inspect(name)
                    listed = info.fencing_token if info and info.owner == lease.owner else None
                    if listed not in (None, lease.fencing_token):
                        problems.append(f"listed {listed}, held {lease.fencing_token}")
                    with guard:
                        if alias in inside:
                            inside.remove(alias)
            except (LockNotAcquired, LockLost):
                with guard:
                    if alias in inside:
                        inside.remove(alias)  # evicted by a force release: out now

    threads = [threading.Thread(target=run, args=pair) for pair in zip(aliases, plans, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert not problems, problems
    counter = get_backend(aliases[0]).fencing_counter(name)
    assert not grants or counter >= grants[-1]
