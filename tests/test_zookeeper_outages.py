"""The ZooKeeper backend through outages, on a standalone server of each test's own:
the session timeout the server grants, leases declared lost while the session lives
on, acquisitions that meet an outage, and what a failed clean-up logs.

The client reaches the server through a loopback proxy (tests/faults/proxy.py) that
cuts it off on demand, while other clients still reach the server directly.
Skipped, saying what to install, where java or the ZooKeeper jars are missing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from distlocks import get_backend, lock, semaphore
from distlocks.backends.base import SEMAPHORE, Holder
from distlocks.exceptions import LockBackendUnavailable
from distlocks.testing.zookeeper_server import ZooKeeperServer, zookeeper_missing
from tests.faults.proxy import FaultProxy

pytestmark = pytest.mark.skipif(bool(zookeeper_missing()), reason=zookeeper_missing())

BACKEND = "distlocks.backends.zookeeper.ZooKeeperBackend"
HOLDER = Holder(host="test", pid=1, thread="t")


def zk_config(location: str, **options: Any) -> dict[str, Any]:
    return {"BACKEND": BACKEND, "LOCATION": location, "OPTIONS": options}


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def short_sessions() -> Iterator[ZooKeeperServer]:
    """A server that grants sessions of 2 s at most, whatever a client asks for."""
    server = ZooKeeperServer(max_session_ms=2000).start()
    yield server
    server.close()


@pytest.fixture
def server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


def close_clients() -> None:
    """Stop every backend's client before a proxy goes: a client left reconnecting
    through a closing proxy leaves it coroutines that never end."""
    from distlocks.handler import backends

    backends.reset()


@pytest.fixture
def proxy(server: ZooKeeperServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(server.port).start()
    yield proxy
    close_clients()
    proxy.close()


def connected(alias: str) -> bool:
    """Whether the backend answers (the cut is over and kazoo reconnected)."""
    try:
        get_backend(alias).contenders("-")
    except LockBackendUnavailable:
        return False
    return True


# -- the session timeout the server grants ------------------------------------------


def test_the_session_timeout_the_server_grants_is_the_one_counted(
    settings: Any, short_sessions: ZooKeeperServer, name: str, caplog: Any
) -> None:
    """The client asks for 4 s, the server grants 2 s. Leases count with 2 s: the
    shorter grant and a ttl longer than it are warned about, and a holder cut off
    from the server no longer confirms its lease once the server may have freed the
    lock (here: once another client got it)."""
    proxy = FaultProxy(short_sessions.port).start()
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkg": zk_config(f"127.0.0.1:{proxy.port}", session_timeout=4, connect_timeout=0.3,
                         socket_timeout=0.3),
        "zkd": zk_config(short_sessions.location, session_timeout=2),
    }  # fmt: skip
    try:
        backend = get_backend("zkg")
        caplog.set_level(logging.WARNING, logger="distlocks")
        assert backend.acquire(name, "holder", 4, HOLDER).acquired
        assert backend.session_seconds == 2.0
        warnings = [r.getMessage() for r in caplog.records if r.name.startswith("distlocks")]
        assert any("granted backend 'zkg' a 2s session, not the 4s" in w for w in warnings)
        assert any("ttl 4s" in w and "session timeout (2s; 4s asked)" in w for w in warnings)

        # Cut off without a word (the server hears nothing, nor does the client).
        proxy.blackhole()
        with lock(name, backend="zkd", ttl=2, timeout=30) as other:
            # The server expired the holder's session and gave the lock to another:
            # the holder, still cut off, must not confirm its lease now.
            assert not backend.extend(name, "holder", 4)
            assert other.held()
    finally:
        close_clients()
        proxy.close()


# -- a lease declared lost while its session lives on ---------------------------------


def holders(alias: str, kind: str, name: str) -> list[str]:
    """The owners of the nodes of lock ``name`` (``kind`` "lock") or of semaphore
    ``name``, in queue order."""
    backend = get_backend(alias)
    if kind == "lock":
        return backend.contenders(name)
    return [info.owner for info in backend.permit_holders(SEMAPHORE, name)]


@pytest.mark.parametrize("kind", ["lock", SEMAPHORE])
def test_a_lease_declared_lost_while_its_session_lives_on_leaves_no_node_behind(
    settings: Any, server: ZooKeeperServer, proxy: FaultProxy, name: str, kind: str
) -> None:
    """The holder is cut off. kazoo pinged the server a moment ago, but the holder
    cannot know when: its renewal must assume the server last heard from it up to
    2/3 of a session before the cut, so it declares the lease lost a third of a
    session in (the server may have freed the lock). The cut ends before the session
    expires, so the session, and with it the node, lives on; the lease's owner will
    not release a lease found lost at renewal. The node must go all the same, once
    the server answers, or the lock stays held by nobody for as long as the process
    lives."""
    session_timeout = 12  # a third of it to lose the lease, two to spare
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkp": zk_config(f"127.0.0.1:{proxy.port}", session_timeout=session_timeout,
                         connect_timeout=0.3, socket_timeout=0.3),
        "zkd": zk_config(server.location),
    }  # fmt: skip
    backend = get_backend("zkp")
    if kind == "lock":
        assert backend.acquire(name, "holder", session_timeout, HOLDER).acquired
    else:
        assert backend.permit_acquire(kind, name, "holder", session_timeout, HOLDER).acquired
    session = backend.session_id()
    # Only kazoo's pings from now on, for longer than 2/3 of the session.
    quiet_until = time.monotonic() + session_timeout * 2 / 3 + 0.5
    wait_for(lambda: time.monotonic() >= quiet_until)
    proxy.drop()
    proxy.reset()
    outcomes: list[bool | str] = []

    def renewal_gives_up() -> bool:
        try:
            if kind == "lock":
                outcomes.append(backend.extend(name, "holder", session_timeout))
            else:
                outcomes.append(backend.permit_extend(kind, name, "holder", session_timeout))
        except LockBackendUnavailable:
            outcomes.append("unavailable")  # not yet: tried again, as the renewer does
        return outcomes[-1] is False

    wait_for(renewal_gives_up)
    proxy.heal()
    wait_for(lambda: connected("zkp"))
    # The session outlived the cut (the scenario of this test).
    assert backend.session_id() == session
    wait_for(lambda: holders("zkd", kind, name) == [])


# -- what a failed clean-up logs -------------------------------------------------------------


def test_releases_after_an_outage_log_one_line(
    settings: Any, server: ZooKeeperServer, name: str, caplog: Any
) -> None:
    """A release after the session expired asks the server nothing; a lost lease that
    cannot be given back (the server is down) logs one line at WARNING with the
    cause, and the traceback only at DEBUG."""
    from tests.test_zookeeper import expire_session

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkl": zk_config(server.location, session_timeout=4, connect_timeout=0.3,
                         socket_timeout=0.3),
    }  # fmt: skip
    backend = get_backend("zkl")
    expired = lock(name, backend="zkl", ttl=4, timeout=1, auto_renew=False).acquire()
    generation = backend._generation
    expire_session(backend, server.location)
    wait_for(lambda: backend._generation > generation)  # kazoo heard of the expiry
    wait_for(lambda: connected("zkl"))  # on a new session
    cut_off = lock(f"{name}:2", backend="zkl", ttl=1, timeout=1, auto_renew=False).acquire()
    server.stop()
    caplog.set_level(logging.DEBUG, logger="distlocks")
    caplog.clear()
    # Held locally still, but its session expired: False, without asking the server.
    assert expired.release() is False
    assert not [r for r in caplog.records if r.exc_info]
    wait_for(lambda: not cut_off.held())
    caplog.clear()
    assert cut_off.release() is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    failures = [r for r in warnings if "Could not release" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in warnings]
    assert "LockBackendUnavailable" in failures[0].getMessage()
    assert "\n" not in failures[0].getMessage()
    assert not [r for r in warnings if r.exc_info]
    assert [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]


# -- acquisitions that meet an outage -----------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", SEMAPHORE])
def test_an_acquire_with_a_timeout_waits_out_a_short_outage(
    settings: Any, server: ZooKeeperServer, proxy: FaultProxy, name: str, kind: str
) -> None:
    """The server cannot be reached for a while, well within the caller's timeout: the
    acquire tries again until it can, instead of failing at the first attempt."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zko": zk_config(f"127.0.0.1:{proxy.port}", session_timeout=8, connect_timeout=0.3,
                         socket_timeout=0.3),
    }  # fmt: skip
    with lock(f"{name}:warm", backend="zko", ttl=8, timeout=1):
        pass
    proxy.drop()
    proxy.reset()
    outcome: list[Any] = []

    def acquire() -> None:
        try:
            if kind == "lock":
                outcome.append(lock(name, backend="zko", ttl=8, timeout=30).acquire())
            else:
                outcome.append(semaphore(name, limit=2, backend="zko", ttl=8, timeout=30).acquire())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=acquire)
    thread.start()
    # Past a few attempts (each waits connect_timeout for the connection).
    wait_for(lambda: proxy.stats["dropped"] >= 6 or bool(outcome))
    proxy.heal()
    thread.join(40)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    lease = outcome[0]
    assert lease.held()
    assert holders("zko", kind, name) == [lease.owner]
    lease.release()


def test_a_create_left_without_an_answer_is_found_before_another(
    settings: Any, server: ZooKeeperServer, proxy: FaultProxy, name: str
) -> None:
    """The create of the contender node reaches the server, but its answer comes after
    the caller stopped waiting for it. The acquire tries again: it first looks for the
    node by its owner-tagged name, finds it and takes it over, sending no second
    create."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zks": zk_config(f"127.0.0.1:{proxy.port}", session_timeout=10, connect_timeout=0.3,
                         socket_timeout=0.3),
        "zkd": zk_config(server.location),
    }  # fmt: skip
    backend = get_backend("zks")
    with lock(name, backend="zks", ttl=10, timeout=1):
        pass  # connected, and the name's fence node made
    create = b'"owner":"slow-owner"'  # in the create's node data, nowhere else
    proxy.watch(create)
    client = backend._ready("test", name)
    call = client._call

    def slow_from_the_create(request: Any, async_object: Any) -> Any:
        # The acquire lists first (answered in time), then the multi-op goes slowly.
        if type(request).__name__ == "Transaction":
            proxy.set_latency(1.0)  # each way: longer than socket_timeout
        return call(request, async_object)

    client._call = slow_from_the_create
    outcome: list[Any] = []

    def acquire() -> None:
        try:
            outcome.append(backend.acquire(name, "slow-owner", 10, HOLDER, wait=30))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=acquire)
    thread.start()
    try:
        # The create reached the server; its answer is still on its way back.
        wait_for(lambda: get_backend("zkd").contenders(name) == ["slow-owner"])
        assert not outcome
    finally:
        client._call = call
        proxy.set_latency(0)
    thread.join(40)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    assert outcome[0].acquired
    assert proxy.seen[create] == 1
    assert get_backend("zkd").contenders(name) == ["slow-owner"]
    assert backend.release(name, "slow-owner")


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_lease_is_never_trusted_longer_than_the_granted_session(
    settings: Any, short_sessions: ZooKeeperServer, name: str, kind: str
) -> None:
    """ttl <= the asked session_timeout (the documented safe setting), but the server
    grants a shorter session: the lease's local deadline follows the granted session,
    at acquire and at every extend, so a holder paused past it stops trusting it."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkg": zk_config(short_sessions.location, session_timeout=4),
    }
    try:
        if kind == "lock":
            lease = lock(name, backend="zkg", ttl=4, timeout=5, auto_renew=False).acquire()
        else:
            from distlocks import semaphore

            lease = semaphore(name, limit=2, backend="zkg", ttl=4, timeout=5,
                              auto_renew=False).acquire()  # fmt: skip
        try:
            assert get_backend("zkg").session_seconds == 2.0
            remaining = lease.remaining()
            assert remaining is not None and remaining <= 2.0, remaining
            lease.extend(4)
            remaining = lease.remaining()
            assert remaining is not None and remaining <= 2.0, remaining
        finally:
            lease.release()
    finally:
        close_clients()
