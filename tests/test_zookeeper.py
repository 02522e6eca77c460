"""The ZooKeeper backend on a real standalone ZooKeeper (Debian's jars, started here).

Skipped, saying what to install, where java or the ZooKeeper jars are missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from distlocks import alock, get_backend, lock, rwlock, semaphore
from distlocks.backends.base import Holder
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from distlocks.testing.zookeeper_server import ZooKeeperServer, zookeeper_missing
from tests import waiting, zookeeper_workers

pytestmark = pytest.mark.skipif(bool(zookeeper_missing()), reason=zookeeper_missing())

BACKEND = "distlocks.backends.zookeeper.ZooKeeperBackend"
HOLDER = Holder(host="test", pid=1, thread="t")


def four_letter(server: ZooKeeperServer, word: bytes = b"srvr") -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        sock.sendall(word)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    pairs = (line.split(":", 1) for line in reply.decode().splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def last_zxid(server: ZooKeeperServer) -> int:
    """The server's last zxid: it moves with every write, and only with writes."""
    return int(four_letter(server)["Zxid"], 16)


def received(server: ZooKeeperServer, session: int) -> int:
    """Requests (and pings) the server has received so far on ``session``."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        sock.sendall(b"cons")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    for line in reply.decode().splitlines():
        if f"sid=0x{session:x}," in line:
            return int(line.split("recved=")[1].split(",")[0])
    raise AssertionError(f"session 0x{session:x} not connected: {reply!r}")


@pytest.fixture(scope="module")
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


def zk_config(location: str, **options: Any) -> dict[str, Any]:
    return {"BACKEND": BACKEND, "LOCATION": location, "OPTIONS": options}


@pytest.fixture
def zk(settings: Any, zk_server: ZooKeeperServer) -> str:
    """The alias of a ZooKeeper backend on the module's server."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zk": zk_config(zk_server.location, session_timeout=4),
    }
    return "zk"


@pytest.fixture
def own_zk(tmp_path: Path) -> Iterator[ZooKeeperServer]:
    """A server of the test's own, to stop or freeze."""
    server = ZooKeeperServer().start()
    yield server
    server.close()


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def expire_session(backend: Any, location: str, stall: float = 0.0) -> None:
    """End ``backend``'s session on the server, and return once the backend heard it
    (its ``_generation`` moved): another client takes the session over and closes it.

    Taking it over cuts the backend's connection, and its client reconnects 50 ms
    later (its connection retry). If that is before the other client's close (a
    stall of the test's thread on a loaded machine, or ``stall``), the backend takes
    the live session back, the server drops the other client, and its stop closes
    nothing: the session lives on, rightly unreported. So take it over again until
    the backend hears the loss."""
    from kazoo.client import KazooClient
    from kazoo.protocol.states import KazooState

    client = backend._client
    session_id, password = client.client_id
    generation = backend._generation
    states: list[str] = []
    client.add_listener(states.append)
    try:
        for _ in range(10):
            states.clear()
            other = KazooClient(hosts=location, client_id=(session_id, password))
            other.start(timeout=10)
            time.sleep(stall)
            other.stop()
            other.close()
            # Either the close went through (the backend hears LOST), or the backend
            # reconnected to its live session (cut off, then CONNECTED again).
            wait_for(
                lambda: (
                    backend._generation > generation
                    or (KazooState.SUSPENDED in states and states[-1] == KazooState.CONNECTED)
                ),
                timeout=30,
            )
            if backend._generation > generation:
                return
        raise AssertionError(f"session {session_id:#x} taken back by its backend 10 times")
    finally:
        client.remove_listener(states.append)


# -- the basics ------------------------------------------------------------------------


def test_acquire_extend_release(zk: str, name: str) -> None:
    backend = get_backend(zk)
    with lock(name, backend=zk, ttl=5, timeout=1) as lease:
        assert lease.fencing_token > 0
        assert backend.fencing_counter(name) == lease.fencing_token
        info = backend.inspect(name)
        assert info is not None
        assert (info.owner, info.fencing_token, info.waiters) == (
            lease.owner,
            lease.fencing_token,
            0,
        )
        assert info.pid == os.getpid() and info.ttl == 5
        assert [i.name for i in backend.iter_locks() if i.name == name] == [name]
        lease.extend(3)
        assert lease.held() and lease.renewals == 1
        with pytest.raises(LockNotAcquired):
            lock(name, backend=zk, ttl=5, timeout=0).acquire()
    assert backend.inspect(name) is None
    assert backend.contenders(name) == []
    assert not backend.release(name, lease.owner)  # idempotent, and only its own


def test_tokens_strictly_increase_per_name(zk: str, name: str) -> None:
    backend = get_backend(zk)
    tokens = []
    for _ in range(5):
        with lock(name, backend=zk, ttl=5, timeout=1) as lease:
            tokens.append(lease.fencing_token)
    with lock(f"{name}:other", backend=zk, ttl=5, timeout=1):
        pass
    holder = lock(name, backend=zk, ttl=5, timeout=1).acquire()
    tokens.append(holder.fencing_token)
    assert backend.force_release(name, holder.fencing_token)
    assert backend.fencing_counter(name) > holder.fencing_token
    with lock(name, backend=zk, ttl=5, timeout=1) as lease:
        tokens.append(lease.fencing_token)
    assert tokens == sorted(set(tokens)), tokens
    assert tokens[-1] > backend.fencing_counter(name) - 1


def test_retried_acquire_finds_its_own_node(zk: str, name: str) -> None:
    backend = get_backend(zk)
    first = backend.acquire(name, "owner-1", 5, HOLDER)
    again = backend.acquire(name, "owner-1", 5, HOLDER)
    assert first.acquired and again.acquired
    assert again.fencing_token == first.fencing_token
    assert backend.contenders(name) == ["owner-1"]
    # A fresh backend object (no memory of the node) finds it on the server too,
    # as long as it is the same session's... or any: the owner names the node.
    backend._nodes.clear()
    assert backend.acquire(name, "owner-1", 5, HOLDER).fencing_token == first.fencing_token
    assert backend.contenders(name) == ["owner-1"]
    assert backend.release(name, "owner-1")
    assert not backend.release(name, "owner-1")


class Requests:
    """The requests a backend's kazoo client sends, by type, recorded where kazoo queues
    them (``KazooClient._call``; pings do not go through it): the real requests reach
    the real server unchanged. ``before`` runs just before a request of a type is
    queued (once), to make a race happen at a chosen point."""

    def __init__(self, client: Any) -> None:
        self.sent: list[str] = []
        self.before: dict[str, Any] = {}
        self._client = client
        self._call = client._call

    def __enter__(self) -> Requests:
        def call(request: Any, async_object: Any) -> Any:
            kind = type(request).__name__
            hook = self.before.pop(kind, None)
            if hook is not None:
                hook()
            self.sent.append(kind)
            return self._call(request, async_object)

        self._client._call = call
        return self

    def __exit__(self, *exc: object) -> None:
        self._client._call = self._call


def test_try_once_on_a_free_lock_is_three_requests(zk: str, name: str) -> None:
    """List, then one multi-op queueing the node only if the fence node is unchanged
    since the listing (so the node is alone: it holds, no second listing), then the
    release's delete."""
    backend = get_backend(zk)
    assert backend.acquire(f"{name}:first-use", "o", 5, HOLDER).acquired
    with lock(name, backend=zk, ttl=5, timeout=1):
        pass  # the name's fence node exists: its first use is not what is counted
    with Requests(backend._ready("test", name)) as requests:
        result = backend.acquire(name, "owner-1", 5, HOLDER)
        assert result.acquired
        assert backend.release(name, "owner-1")
    assert requests.sent == ["GetChildren2", "Transaction", "Delete"]
    assert result.fencing_token == backend.fencing_counter(name)
    assert backend.contenders(name) == []


def test_try_once_raced_by_a_contender_is_refused_writing_nothing(
    zk: str, name: str, zk_server: ZooKeeperServer
) -> None:
    """Another session queues between this caller's listing (free) and its multi-op:
    the multi-op fails as a whole, so no node of this caller is left, the fence node is
    last written by the other, which holds, with a later token."""
    backend = get_backend(zk)
    other = type(backend)("zk-other", {"LOCATION": zk_server.location})
    try:
        other._ready("test", name)  # its session is made before the race, not in it
        with lock(name, backend=zk, ttl=5, timeout=1) as earlier:
            pass
        raced: list[Any] = []
        with Requests(backend._ready("test", name)) as requests:
            requests.before["Transaction"] = lambda: raced.append(
                other.acquire(name, "other", 5, HOLDER)
            )
            result = backend.acquire(name, "owner-1", 5, HOLDER)
        assert not result.acquired
        assert raced and raced[0].acquired and raced[0].fencing_token > earlier.fencing_token
        assert backend.contenders(name) == ["other"]
        # The fence node was last written by the other's multi-op: this caller's was
        # rolled back as a whole (it would have written the fence node after the other's).
        assert backend.fencing_counter(name) == raced[0].fencing_token
        assert requests.sent[:2] == ["GetChildren2", "Transaction"]
        assert "Delete" not in requests.sent
        assert other.release(name, "other")
        with lock(name, backend=zk, ttl=5, timeout=0) as later:
            assert later.fencing_token > raced[0].fencing_token
    finally:
        other.close()


#: One step of try-once callers on one lock, each on a session of its own: ("acquire",
#: i, race) where race, when not None, is ("acquire", j) or ("cycle", j): caller j
#: acquires (and, for "cycle", releases again) just before caller i's multi-op is sent,
#: between its listing and its write; or ("release", i, None).
STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("acquire"),
            st.integers(0, 2),
            st.none() | st.tuples(st.sampled_from(["acquire", "cycle"]), st.integers(0, 2)),
        ),
        st.tuples(st.just("release"), st.integers(0, 2), st.none()),
    ),
    max_size=12,
)


@hypothesis.settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS)
def test_try_once_races_keep_the_lock_exclusive_and_leave_no_node(
    zk_server: ZooKeeperServer, steps: list[tuple[str, int, Any]]
) -> None:
    """Whatever races the conditional multi-op meets: at most one caller holds, the
    nodes on the server are exactly the holder's, a refused caller leaves no node,
    tokens strictly increase, and a caller with no race on a free lock gets it."""
    from distlocks.backends.zookeeper import ZooKeeperBackend

    backends = [
        ZooKeeperBackend(f"zk-race-{i}", {"LOCATION": zk_server.location}) for i in range(3)
    ]
    name = f"race-{uuid.uuid4().hex}"
    owners = [f"owner-{i}" for i in range(3)]
    holder: int | None = None
    tokens: list[int] = []

    def acquire(i: int) -> bool:
        nonlocal holder
        result = backends[i].acquire(name, owners[i], 5, HOLDER)
        if result.acquired:
            assert holder in (None, i), f"{i} acquired while {holder} held"
            if holder is None:
                assert not tokens or result.fencing_token > tokens[-1]
                tokens.append(result.fencing_token)
            else:
                assert result.fencing_token == tokens[-1]  # a retried acquire
            holder = i
        return result.acquired

    def release(i: int) -> None:
        nonlocal holder
        assert backends[i].release(name, owners[i]) == (holder == i)
        if holder == i:
            holder = None

    try:
        for step, i, race in steps:
            if step == "release":
                release(i)
            else:
                free = holder is None
                with Requests(backends[i]._ready("test", name)) as requests:
                    if race is not None and race[1] != i:
                        what, j = race

                        def cut_in(what: str = what, j: int = j) -> None:
                            acquire(j)
                            if what == "cycle":
                                release(j)

                        requests.before["Transaction"] = cut_in
                    got = acquire(i)
                if free and (race is None or race[1] == i):
                    assert got, "a try-once caller with no race was refused a free lock"
            expected = [owners[holder]] if holder is not None else []
            assert backends[0].contenders(name) == expected
    finally:
        for backend in backends:
            backend.close()


def test_name_with_slashes_and_unicode(zk: str, name: str) -> None:
    odd = f"{name}/a/../b ü %2F ."
    backend = get_backend(zk)
    with lock(odd, backend=zk, ttl=5, timeout=1) as lease:
        assert backend.inspect(odd).fencing_token == lease.fencing_token  # type: ignore[union-attr]
        assert odd in {info.name for info in backend.iter_locks()}


# -- waiting -----------------------------------------------------------------------------


def test_waiter_is_woken_by_the_release_without_polling(
    zk: str, name: str, zk_server: ZooKeeperServer
) -> None:
    backend = get_backend(zk)
    holder = lock(name, backend=zk, ttl=30, timeout=1).acquire()
    got: list[float] = []

    def waiter() -> None:
        with lock(name, backend=zk, ttl=30, timeout=20):
            got.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_for(lambda: len(backend.contenders(name)) == 2)
    # The waiter is in wait() once it registered its wake-up (its watch is set a
    # round trip later).
    wait_for(lambda: bool(backend._waiting))
    time.sleep(0.1)
    session = backend.session_id()
    assert session is not None
    before = received(zk_server, session)
    time.sleep(2)
    # Pings only (a 4 s session pings every ~1-1.3 s); a waiter polling every 100 ms
    # would have sent 20 requests.
    assert received(zk_server, session) - before <= 3
    released_at = time.monotonic()
    holder.release()
    thread.join(10)
    assert got and got[0] - released_at < 0.5


def watching(client: Any, path: str, watches: int = 1) -> bool:
    """Whether ``client`` has ``watches`` watches on ``path`` set (kazoo records each
    on the reply)."""
    return len(client._data_watchers.get(path, ())) >= watches


class Waiter:
    """A thread waiting in ``lock(name, timeout=...).acquire()``; ``lease`` once granted."""

    def __init__(
        self,
        alias: str,
        name: str,
        timeout: float = 20,
        granted: Callable[[Waiter], None] | None = None,
    ) -> None:
        self.lease: Any = None
        self.error: BaseException | None = None
        #: Whether its node was the first on the server at its grant (see ``granted``).
        self.first = False
        #: A waiter meant to give up (a short timeout).
        self.quits = False
        self._granted = granted
        self.thread = threading.Thread(target=self._run, args=(alias, name, timeout))
        self.thread.start()

    def _run(self, alias: str, name: str, timeout: float) -> None:
        try:
            # No renewal: its requests would be counted with the hand-off's.
            self.lease = lock(
                name, backend=alias, ttl=4, timeout=timeout, auto_renew=False
            ).acquire()
            if self._granted is not None:
                self._granted(self)  # before anyone is told it holds
        except BaseException as exc:
            self.error = exc

    def join(self) -> Any:
        self.thread.join(20)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.lease


def test_a_waiter_behind_the_holder_takes_the_lock_with_no_request_after_the_wake(
    zk: str, name: str
) -> None:
    """A waiter queues in three requests (the listing, the multi-op at the fence node's
    listed version, a watch on the node just ahead: no second listing), and when the
    node it watches was the holder's, the watch firing on the node's deletion means it
    now holds: nobody can have queued ahead of it, so the hand-off needs no request
    after the release's delete."""
    backend = get_backend(zk)
    first = backend.acquire(name, "holder", 30, HOLDER)
    assert first.acquired
    client = backend._ready("test", name)
    holder_path = backend._nodes[(name, "holder")].path
    with Requests(client) as requests:
        waiter = Waiter(zk, name)
        wait_for(lambda: watching(client, holder_path))
        # The watch on the node ahead, and one on its own node (see the next test).
        assert requests.sent == ["GetChildren2", "Transaction", "Exists", "Exists"]
        assert backend.release(name, "holder")
        lease = waiter.join()
        assert requests.sent[4:] == ["Delete"]
    assert lease.fencing_token > first.fencing_token
    # Its multi-op was the last write of the fence node: the token is the counter.
    assert lease.fencing_token == backend.fencing_counter(name)
    assert backend.contenders(name) == [lease.owner]
    lease.release()
    assert backend.contenders(name) == []


def test_a_waiter_whose_holder_went_before_its_watch_holds_with_no_listing(
    zk: str, name: str, zk_server: ZooKeeperServer
) -> None:
    """The holder (another session) releases between the waiter's listing and its
    watch: the watch finds the node gone and the waiter's own node there (answered in
    that order), so nothing can be ahead of it: it holds, with no second listing."""
    backend = get_backend(zk)
    other = type(backend)("zk-other", {"LOCATION": zk_server.location})
    try:
        first = other.acquire(name, "holder", 30, HOLDER)
        assert first.acquired
        with Requests(backend._ready("test", name)) as requests:
            requests.before["Exists"] = lambda: other.release(name, "holder")
            lease = Waiter(zk, name).join()
        assert requests.sent == ["GetChildren2", "Transaction", "Exists", "Exists"]
        assert lease.fencing_token > first.fencing_token
        assert backend.contenders(name) == [lease.owner]
        lease.release()
    finally:
        other.close()


def test_a_waiter_whose_node_is_deleted_by_hand_is_not_granted_by_its_watch(
    zk: str, name: str, zk_server: ZooKeeperServer
) -> None:
    """The waiter just behind the holder would take the holder's going as its grant;
    its node deleted meanwhile (nothing in distlocks does that: an operator, another
    tool), the watch on its own node fires first, and it queues again instead of
    holding the lock with no node."""
    from kazoo.client import KazooClient

    backend = get_backend(zk)
    first = backend.acquire(name, "holder", 30, HOLDER)
    client = backend._ready("test", name)
    holder_path = backend._nodes[(name, "holder")].path
    waiter = Waiter(zk, name)
    wait_for(lambda: watching(client, holder_path))
    (path,) = (node.path for (n, o), node in backend._nodes.items() if n == name and o != "holder")
    wait_for(lambda: watching(client, path))
    operator = KazooClient(hosts=zk_server.location)
    operator.start(timeout=10)
    try:
        operator.delete(path)
        # It finds its node gone (and waits for the holder to queue again, as a waiter
        # forced out does): not granted.
        wait_for(lambda: all(node.path != path for node in list(backend._nodes.values())))
        assert waiter.lease is None
        assert backend.release(name, "holder")
        lease = waiter.join()
        assert lease.fencing_token > first.fencing_token
        assert backend.contenders(name) == [lease.owner]
        lease.release()
    finally:
        operator.stop()
        operator.close()


def test_a_waiter_deeper_in_the_queue_lists_once_when_woken(zk: str, name: str) -> None:
    """Holder, then two waiters: the first waiter gets the lock at the holder's release
    with no request; the second, whose watched node was a waiter's when it queued,
    lists the contenders once when that node goes (sent as the watch fires), and holds."""
    backend = get_backend(zk)
    assert backend.acquire(name, "holder", 30, HOLDER).acquired
    client = backend._ready("test", name)
    holder_path = backend._nodes[(name, "holder")].path
    with Requests(client) as requests:
        one = Waiter(zk, name)
        wait_for(lambda: watching(client, holder_path))
        (one_path,) = (
            node.path for (n, o), node in backend._nodes.items() if n == name and o != "holder"
        )
        two = Waiter(zk, name)
        # The second watch on it (the first is its owner's, on its own node).
        wait_for(lambda: watching(client, one_path, 2))
        queueing = ["GetChildren2", "Transaction", "Exists"]
        assert requests.sent == [*queueing, "Exists", *queueing]
        assert backend.release(name, "holder")
        first = one.join()
        assert requests.sent[7:] == ["Delete"]
        assert two.thread.is_alive()
        first.release()
        second = two.join()
        assert requests.sent[8:] == ["Delete", "GetChildren2"]
    assert second.fencing_token > first.fencing_token
    second.release()
    assert backend.contenders(name) == []


#: One step of waiters on one lock: ("join", b) a waiter on backend b (two sessions,
#: each shared by its waiters) queues; ("quit", b) one queues with a short timeout, so
#: that it gives up wherever it is in the queue then (or holds, if its turn came);
#: ("release", 0) the holder releases; ("force", b) the holder is force-released (no
#: token). A step comes once the waiter before it has its node on the server, often
#: before its watch is set.
HANDOFF_STEPS = st.lists(
    st.tuples(st.sampled_from(["join", "quit", "release", "force"]), st.integers(0, 1)),
    max_size=10,
)


@hypothesis.settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=HANDOFF_STEPS)
# A waiter gives up between the holder and another waiter: the one behind it is woken,
# and must list (its watched node was not the holder's), not take the lock.
@hypothesis.example(steps=[("join", 0), ("quit", 1), ("join", 0)])
def test_hand_offs_keep_arrival_order_and_leave_no_node(
    settings: Any, zk_server: ZooKeeperServer, steps: list[tuple[str, int]]
) -> None:
    """Whatever the order of joins, give-ups (anywhere in the queue), releases and
    evictions, and whether the node ahead goes before or after a waiter's watch is
    set: each grant goes to the first node on the server (checked by the grantee at
    its grant, before anyone may release or evict it), one lease at a time, in
    arrival order (tokens strictly increase in the order of the grants), and once
    every waiter ended, no node is left."""
    aliases = [f"zk-handoff-{i}" for i in range(2)]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        **{alias: zk_config(zk_server.location, session_timeout=10) for alias in aliases},
    }
    backends = [get_backend(alias) for alias in aliases]
    name = f"handoff-{uuid.uuid4().hex}"
    grants: list[Waiter] = []
    everyone: list[Waiter] = []
    ended: set[Waiter] = set()  # released or evicted

    def on_server() -> list[str]:
        return backends[0].contenders(name)

    def at_grant(waiter: Waiter) -> None:
        waiter.first = on_server()[:1] == [waiter.lease.owner]
        grants.append(waiter)

    def holding() -> list[Waiter]:
        return [w for w in grants if w not in ended]

    def settled() -> bool:
        """The first node on the server is a granted waiter's (or there is none)."""
        queue = on_server()
        return not queue or any(w.lease.owner == queue[0] for w in holding())

    try:
        for step, b in steps:
            if step in ("join", "quit"):
                before = set(on_server())
                waiter = Waiter(aliases[b], name, 20 if step == "join" else 0.3, at_grant)
                waiter.quits = step == "quit"
                everyone.append(waiter)
                # Queued (or already gone again, a quitter under load): a node that was not
                # there before, only this step adds one. (Not a count: an earlier quitter
                # giving up meanwhile takes one away, and the count stayed where it was.)
                wait_for(
                    lambda waiter=waiter, before=before: (
                        bool(set(on_server()) - before) or not waiter.thread.is_alive()
                    )
                )
            else:
                wait_for(settled)
                current = holding()
                if current:
                    if step == "release":
                        ended.add(current[0])
                        current[0].lease.release()
                    else:
                        ended.add(current[0])
                        assert backends[b].force_release(name, current[0].lease.fencing_token)
            assert len(holding()) <= 1, "two leases held at once"
        # The quitters give up (behind the holder, from anywhere in the queue) first...
        for waiter in everyone:
            if waiter.quits:
                waiter.thread.join(30)
        # ...then every other waiter gets the lock in turn.
        for waiter in everyone:
            while waiter.thread.is_alive():
                wait_for(settled, timeout=30)
                for holder in holding():
                    ended.add(holder)
                    holder.lease.release()
                time.sleep(0.01)
            assert waiter.error is None or isinstance(waiter.error, LockNotAcquired)
        for holder in holding():
            ended.add(holder)
            holder.lease.release()
        assert all(w.first for w in grants), "granted while not first on the server"
        tokens = [w.lease.fencing_token for w in grants]
        assert tokens == sorted(set(tokens)), "not granted in arrival order"
        assert on_server() == []
    finally:
        for waiter in everyone:
            waiter.thread.join(30)
            if waiter.lease is not None:
                with contextlib.suppress(Exception):
                    waiter.lease.release()


def test_waiters_get_the_lock_in_arrival_order(zk: str, name: str) -> None:
    backend = get_backend(zk)
    holder = lock(name, backend=zk, ttl=30, timeout=1).acquire()
    order: list[int] = []

    def waiter(index: int) -> None:
        with lock(name, backend=zk, ttl=30, timeout=20):
            order.append(index)
            time.sleep(0.01)

    threads = []
    for index in range(4):
        thread = threading.Thread(target=waiter, args=(index,))
        thread.start()
        threads.append(thread)
        # Arrival order is the order of the nodes: start the next once this one queued.
        wait_for(lambda index=index: len(backend.contenders(name)) == index + 2)
    holder.release()
    for thread in threads:
        thread.join(20)
    assert order == [0, 1, 2, 3]


def test_waiter_that_times_out_leaves_no_node(zk: str, name: str) -> None:
    backend = get_backend(zk)
    with lock(name, backend=zk, ttl=30, timeout=1) as holder:
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            lock(name, backend=zk, ttl=30, timeout=0.3).acquire()
        assert 0.3 <= time.monotonic() - started < 2
        assert backend.contenders(name) == [holder.owner]
        # A try-once on a busy lock writes nothing at all.
        before = last_zxid_of(zk)
        with pytest.raises(LockNotAcquired):
            lock(name, backend=zk, ttl=30, timeout=0).acquire()
        assert last_zxid_of(zk) == before
    assert backend.contenders(name) == []


def last_zxid_of(alias: str) -> int:
    client = get_backend(alias)._client
    assert client is not None
    host, port = client.hosts[0]
    with socket.create_connection((host, port), timeout=2) as sock:
        sock.sendall(b"srvr")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    line = next(line for line in reply.decode().splitlines() if line.startswith("Zxid:"))
    return int(line.split(":")[1], 16)


def test_a_waiter_leaving_wakes_the_one_behind_it(zk: str, name: str) -> None:
    """The middle waiter gives up: the last one now watches the holder, and gets the
    lock at its release."""
    backend = get_backend(zk)
    holder = lock(name, backend=zk, ttl=30, timeout=1).acquire()
    results: dict[str, Any] = {}

    def quitter() -> None:
        try:
            lock(name, backend=zk, ttl=30, timeout=0.5).acquire()
        except LockNotAcquired as exc:
            results["quitter"] = exc

    def patient() -> None:
        with lock(name, backend=zk, ttl=30, timeout=20):
            results["patient"] = time.monotonic()

    first = threading.Thread(target=quitter)
    first.start()
    wait_for(lambda: len(backend.contenders(name)) == 2)
    second = threading.Thread(target=patient)
    second.start()
    first.join(5)
    assert isinstance(results.get("quitter"), LockNotAcquired)
    assert len(backend.contenders(name)) == 2  # holder and the patient waiter
    released_at = time.monotonic()
    holder.release()
    second.join(10)
    assert results["patient"] - released_at < 0.5


def test_alock(zk: str, name: str) -> None:
    async def main() -> int:
        async with alock(name, backend=zk, ttl=5, timeout=1) as lease:
            assert lease.held()
            return lease.fencing_token

    assert asyncio.run(main()) > 0
    assert get_backend(zk).inspect(name) is None


# -- force release and loss ----------------------------------------------------------------


def test_force_release_is_bound_to_the_token(zk: str, name: str) -> None:
    backend = get_backend(zk)
    lease = lock(name, backend=zk, ttl=0.6, timeout=1).acquire()
    assert not backend.force_release(name, lease.fencing_token - 1)
    assert not backend.force_release(name, lease.fencing_token + 1)
    assert backend.inspect(name).owner == lease.owner  # type: ignore[union-attr]
    assert backend.force_release(name, lease.fencing_token)
    assert backend.inspect(name) is None
    assert backend.fencing_counter(name) > lease.fencing_token
    # The holder hears of it at its next renewal (ttl/3), well before its lease ends.
    wait_for(lambda: not lease.held(), timeout=0.6)
    assert "no longer had it" in lease.lost_reason
    with pytest.raises(LockLost):
        lease.ensure_held()
    assert not lease.release()


def test_force_release_of_a_free_name_writes_nothing(zk: str, name: str) -> None:
    backend = get_backend(zk)
    with lock(name, backend=zk, ttl=5, timeout=1):
        pass
    counter = backend.fencing_counter(name)
    before = last_zxid_of(zk)
    assert not backend.force_release(name)
    assert not backend.force_release(f"{name}:never-used", 123)
    assert last_zxid_of(zk) == before
    assert backend.fencing_counter(name) == counter


def test_force_release_without_token_hands_the_lock_to_the_next_waiter(zk: str, name: str) -> None:
    backend = get_backend(zk)
    holder = lock(name, backend=zk, ttl=30, timeout=1).acquire()
    got: list[int] = []
    thread = threading.Thread(
        target=lambda: got.append(
            lock(name, backend=zk, ttl=30, timeout=10).acquire().fencing_token
        )
    )
    thread.start()
    wait_for(lambda: len(backend.contenders(name)) == 2)
    assert backend.force_release(name)
    thread.join(10)
    assert got and got[0] > holder.fencing_token
    with pytest.raises(LockLost):
        holder.extend()


def test_expire_session_ends_a_session_its_backend_took_back(
    zk: str, zk_server: ZooKeeperServer, name: str
) -> None:
    """The tests' expiry helper, with the stall a loaded machine puts between the
    takeover and the close: the backend reconnects first and keeps its session (a
    single takeover then expires nothing), yet the helper ends it, and the backend
    hears of it: its lease is lost and its node gone."""
    backend = get_backend(zk)
    lease = lock(name, backend=zk, ttl=4, timeout=1, auto_renew=False).acquire()
    generation = backend._generation
    expire_session(backend, zk_server.location, stall=0.3)
    assert backend._generation > generation
    wait_for(lambda: not lease.held(), timeout=20)
    wait_for(lambda: backend.contenders(name) == [], timeout=20)


def test_session_expiry_loses_the_lease(
    settings: Any, zk_server: ZooKeeperServer, name: str
) -> None:

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zk1": zk_config(zk_server.location, session_timeout=1),
    }
    backend = get_backend("zk1")
    lost: list[str] = []
    lease = lock(
        name, backend="zk1", ttl=1, timeout=1, on_lost=lambda gone: lost.append(gone.lost_reason)
    ).acquire()
    # The server expires its session, deleting its nodes; the backend hears it.
    expire_session(backend, zk_server.location)
    wait_for(lambda: not lease.held(), timeout=20)
    # on_lost may come a moment after held() turns false (told on a notice thread).
    wait_for(lambda: bool(lost), timeout=5.0)
    # The lock is free for others at once; the next holder gets a higher token.
    with lock(name, backend="zk1", ttl=1, timeout=5) as again:
        assert again.fencing_token > lease.fencing_token


def test_suspended_session_is_not_trusted_past_the_lease(
    settings: Any, own_zk: ZooKeeperServer, name: str
) -> None:
    """The server stops answering (SIGSTOP): renewals fail, and the lease is lost
    when its local deadline passes, though the session may not have expired yet."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zks": zk_config(own_zk.location, session_timeout=10, connect_timeout=0.3,
                         socket_timeout=0.3),
    }  # fmt: skip
    lease = lock(name, backend="zks", ttl=1, timeout=1).acquire()
    assert own_zk.pid
    os.kill(own_zk.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: not lease.held(), timeout=2.0)
        assert time.monotonic() - stopped <= 1.2
        assert "ran out" in lease.lost_reason
    finally:
        os.kill(own_zk.pid, signal.SIGCONT)


def test_unreachable_server_is_unavailable_quickly(
    settings: Any, own_zk: ZooKeeperServer, name: str
) -> None:
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkd": zk_config(own_zk.location, connect_timeout=0.5, socket_timeout=0.5,
                         auth=[("digest", "user:s3cret-pass")]),
    }  # fmt: skip
    with lock(name, backend="zkd", ttl=5, timeout=1):
        pass
    own_zk.stop()
    for _ in range(2):  # a connected client losing its server, then calls while down
        started = time.monotonic()
        with pytest.raises(LockBackendUnavailable) as caught:
            lock(name, backend="zkd", ttl=5, timeout=1).acquire()
        assert time.monotonic() - started < 1.5
        assert "s3cret-pass" not in str(caught.value)
    get_backend("zkd").close()
    # A new client on a server that is down: bounded by connect_timeout too.
    from distlocks.handler import backends

    backends.reset()
    started = time.monotonic()
    with pytest.raises(LockBackendUnavailable) as caught:
        get_backend("zkd").inspect(name)
    # Nothing listens: refused at once, not after connect_timeout (the admin page lists
    # every backend, and should not wait for one that is down).
    assert time.monotonic() - started < 0.2
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


def test_a_host_name_that_does_not_resolve_is_unavailable_at_once(settings: Any, name: str) -> None:
    """A name no resolver knows (a typo, or a malformed LOCATION that kazoo reads as a
    host name) cannot be connected to any more than a refusing port: the probe fails the
    call at once with the resolver's error, instead of letting kazoo retry the name for
    the whole connect_timeout (a minute here, far past a prompt answer)."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkn": zk_config("nohost.invalid:2181,also-nohost.invalid:2181", connect_timeout=60),
        "zkmixed": zk_config("127.0.0.1:1,nohost.invalid:2181", connect_timeout=60),
    }
    for alias in ("zkn", "zkmixed"):
        with pytest.raises(LockBackendUnavailable) as caught:
            get_backend(alias).inspect(name)
        assert isinstance(caught.value.__cause__, OSError)
        assert not isinstance(caught.value.__cause__, TimeoutError)
        with pytest.raises(LockBackendUnavailable):
            lock(name, backend=alias, ttl=5, timeout=0).acquire()


# -- processes -------------------------------------------------------------------------------


@pytest.mark.slow
def test_processes_racing_never_both_hold(
    zk_server: ZooKeeperServer, name: str, tmp_path: Path
) -> None:
    processes, rounds = 4, 15
    (tmp_path / "counter").write_text("0")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(processes)
    procs = [
        ctx.Process(
            target=zookeeper_workers.race,
            args=(zk_server.location, name, str(tmp_path), rounds, start),
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    assert not (tmp_path / "violations").exists()
    assert int((tmp_path / "counter").read_text()) == processes * rounds


# -- configuration ------------------------------------------------------------------------------


def test_config_problems_are_named() -> None:
    from distlocks.backends.zookeeper import ZooKeeperBackend

    assert ZooKeeperBackend.validate_config("z", zk_config("127.0.0.1:2181/chroot")) == []
    problems = ZooKeeperBackend.validate_config(
        "z",
        {"BACKEND": BACKEND, "LOCATION": "", "OPTIONS": {"session_timeout": 0, "bogus": 1,
                                                          "auth": "user:pw"}},
    )  # fmt: skip
    text = " | ".join(problems)
    assert "LOCATION" in text and "session_timeout" in text and "bogus" in text
    assert "auth" in text and "pw" not in text.replace("password", "")
    with (
        override_settings(DISTLOCKS_BACKENDS={"z": {"BACKEND": BACKEND}}),
        pytest.raises(ImproperlyConfigured),
    ):
        get_backend("z")


def test_chroot_keeps_locks_apart(settings: Any, zk_server: ZooKeeperServer, name: str) -> None:
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zka": zk_config(f"{zk_server.location}/app-a"),
        "zkb": zk_config(f"{zk_server.location}/app-b"),
    }
    with lock(name, backend="zka", ttl=5, timeout=0), lock(name, backend="zkb", ttl=5, timeout=0):
        assert get_backend("zka").inspect(name) is not None


# -- tokens and the clock floor -------------------------------------------------------------


def test_tokens_start_at_the_clock_floor(zk: str, name: str) -> None:
    before_us = time.time_ns() // 1000 - 2_000_000
    with lock(name, backend=zk, ttl=5, timeout=1) as lease:
        pass
    assert before_us <= lease.fencing_token < 2**53


def test_tokens_survive_the_loss_of_all_data(
    settings: Any, own_zk: ZooKeeperServer, name: str
) -> None:
    """The ensemble's data is wiped (zxids start again from 0): tokens still grow."""
    import shutil

    from distlocks.handler import backends

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkw": zk_config(own_zk.location),
    }
    tokens = []
    for _ in range(3):
        with lock(name, backend="zkw", ttl=5, timeout=1) as lease:
            tokens.append(lease.fencing_token)
    backends.reset()
    port = own_zk.port
    own_zk.stop()
    shutil.rmtree(own_zk.base_dir / "data")
    own_zk.start(port=port)
    assert get_backend("zkw").fencing_counter(name) == 0  # the counter is gone...
    with lock(name, backend="zkw", ttl=5, timeout=1) as lease:
        assert lease.fencing_token > max(tokens)  # ...yet the token is above the old ones


@pytest.mark.slow
def test_holder_paused_past_its_session_loses_the_lock(
    zk: str, zk_server: ZooKeeperServer, name: str, tmp_path: Path
) -> None:
    """SIGSTOP the holder past its session timeout: the server frees the lock, a new
    holder gets a higher token, and the resumed holder never claims the lease after
    the new holder got it (its local lease ran out first)."""
    log = tmp_path / "holder.log"
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(
        target=zookeeper_workers.hold_and_report, args=(zk_server.location, name, str(log))
    )
    holder.start()
    try:
        wait_for(lambda: log.exists() and "alive" in log.read_text(), timeout=30)
        assert holder.pid
        os.kill(holder.pid, signal.SIGSTOP)
        with lock(name, backend=zk, ttl=5, timeout=10) as lease:
            taken_at = time.monotonic()
            os.kill(holder.pid, signal.SIGCONT)
            wait_for(lambda: "lost" in log.read_text(), timeout=5)
        first_token = int(log.read_text().split()[1])
        assert lease.fencing_token > first_token
        alive = [float(line.split()[1]) for line in log.read_text().splitlines()
                 if line.startswith("alive")]  # fmt: skip
        assert alive and max(alive) < taken_at
    finally:
        os.kill(holder.pid, signal.SIGCONT)  # type: ignore[arg-type]
        holder.join(10)
        if holder.is_alive():
            holder.kill()


def test_lease_longer_than_the_session_is_lost_once_the_session_may_have_expired(
    settings: Any, own_zk: ZooKeeperServer, name: str
) -> None:
    """ttl 6 s on a 1 s session, server frozen: the first renewal (at 2 s) finds the
    session cut off for longer than it lives, and reports the lease lost then, not at
    its 6 s deadline."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkl": zk_config(own_zk.location, session_timeout=1, connect_timeout=0.3,
                         socket_timeout=0.3),
    }  # fmt: skip
    lease = lock(name, backend="zkl", ttl=6, timeout=1).acquire()
    assert own_zk.pid
    os.kill(own_zk.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: not lease.held(), timeout=4.0)
        assert time.monotonic() - stopped < 3.0
        # Found lost at a renewal, or at the local deadline, which is never later than
        # the granted session (here 1 s, renewed every third of it), whatever the ttl.
        assert "no longer had it" in lease.lost_reason or "ran out" in lease.lost_reason
    finally:
        os.kill(own_zk.pid, signal.SIGCONT)


def test_a_waiter_cut_off_when_it_gives_up_leaves_no_orphan(
    settings: Any, own_zk: ZooKeeperServer, name: str
) -> None:
    """The server becomes unreachable while a waiter waits: its timeout passes and
    deleting its node fails. The server answers again, and the session (which outlived
    the outage) with it, so the node would block the lock for as long as this process
    lives; it is deleted once the server answers again.

    The outage is made by a proxy that cuts the connections and resets new ones, not by
    restarting the server: a client whose reconnect lands while a restarted ZooKeeper
    is still starting can wait in kazoo's handshake for a whole session timeout, which
    made this test fail now and then (a fresh-clone run, on an idle machine)."""
    from tests.faults.proxy import FaultProxy

    proxy = FaultProxy(own_zk.port).start()
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zko": zk_config(f"127.0.0.1:{proxy.port}", session_timeout=20, connect_timeout=0.3,
                         socket_timeout=0.3),
        "zkd": zk_config(own_zk.location),  # another client, straight to the server
    }  # fmt: skip
    try:
        backend = get_backend("zko")
        holder = lock(name, backend="zko", ttl=20, timeout=1).acquire()
        session = backend.session_id()
        errors: list[Exception] = []

        def waiter() -> None:
            try:
                lock(name, backend="zko", ttl=20, timeout=1.0).acquire()
            except Exception as exc:
                errors.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_for(lambda: len(backend.contenders(name)) == 2)
        proxy.drop(True)
        proxy.reset()
        thread.join(30)
        # Timed out, or failed on the unreachable server: either way it gave up.
        assert errors and isinstance(errors[0], LockNotAcquired | LockBackendUnavailable)
        # Still there: only this process could delete it, and it could not reach it.
        assert len(get_backend("zkd").contenders(name)) == 2
        proxy.heal()

        def only_the_holder_left() -> bool:
            try:
                return backend.contenders(name) == [holder.owner]
            except LockBackendUnavailable:
                return False  # still reconnecting

        wait_for(only_the_holder_left, timeout=15)
        assert backend.session_id() == session  # the same session: nothing expired
        assert holder.held()
        holder.release()
        with lock(name, backend="zko", ttl=20, timeout=0):
            pass
    finally:
        proxy.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("pg_ready")
def test_a_holder_whose_session_expired_is_fenced_out(
    settings: Any, zk_server: ZooKeeperServer, name: str
) -> None:
    """The holder's session expires while it is paused; the next holder writes; the
    old holder's write, with its own token, is refused by the database."""

    from distlocks.exceptions import StaleFencingToken
    from tests.testapp.models import Account

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zkf": zk_config(zk_server.location, session_timeout=1),
    }
    row = Account.objects.create(owner="ann", balance=100)
    paused = lock(f"account:{row.pk}", backend="zkf", ttl=1, timeout=1).acquire()
    # The server expires its session, deleting its nodes; the backend hears it.
    expire_session(get_backend("zkf"), zk_server.location)
    with row.fenced_lock(backend="zkf", ttl=1, timeout=5) as lease:
        assert lease.fencing_token > paused.fencing_token
        row.balance = 50
        row.save(fencing_token=lease)
    stale = Account.objects.get(pk=row.pk)
    stale.balance = 0
    with pytest.raises(StaleFencingToken):
        stale.save(fencing_token=paused.fencing_token)
    assert Account.objects.get(pk=row.pk).balance == 50


# -- semaphores and read-write locks ---------------------------------------------------------


def watch_count(server: ZooKeeperServer) -> int:
    """Watches set on the server, by every session (mntr's zk_watch_count)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        sock.sendall(b"mntr")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    line = next(line for line in reply.decode().splitlines() if line.startswith("zk_watch_count"))
    return int(line.split()[1])


def permit_nodes(alias: str, kind: str, name: str) -> list[str]:
    """The owners of the permit nodes of ``name`` in arrival order, each with its kind."""
    from kazoo.exceptions import NoNodeError

    from distlocks.backends.zookeeper import _permit_kind, _permit_nodes, _permit_owner

    backend = get_backend(alias)
    client = backend._client
    assert client is not None
    try:
        children = client.get_children(backend.permit_dir(kind, name))
    except NoNodeError:
        return []
    family = "semaphore" if kind == "semaphore" else "rwlock"
    return [f"{_permit_kind(c)}:{_permit_owner(c)}" for c in _permit_nodes(children, family)]


def test_semaphore_waiter_blocked_makes_no_requests_and_wakes_on_any_release(
    zk: str, name: str, zk_server: ZooKeeperServer
) -> None:
    """Three permits held, a fourth request waits watching all three (the limit nodes
    ahead of it): no request while it waits, and the release of the middle holder
    lets it in. A waiter watching only its predecessor (the third) or only the node
    limit places ahead (the first) would sleep through that release."""
    backend = get_backend(zk)
    sem = semaphore(name, limit=3, backend=zk, ttl=30, auto_renew=False)
    holders = [sem.acquire(timeout=0) for _ in range(3)]
    watches = watch_count(zk_server)
    got: list[float] = []

    def waiter() -> None:
        with semaphore(name, limit=3, backend=zk, ttl=30, timeout=30):
            got.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        # Waiting once its three watches are set on the server.
        waiting.wait_for(lambda: watch_count(zk_server) >= watches + 3, 30, "the watches")
        assert len(permit_nodes(zk, "semaphore", name)) == 4
        session = backend.session_id()
        assert session is not None
        before = received(zk_server, session)
        time.sleep(2)  # the window measured, not a wait for something to happen
        # Pings only (a 4 s session pings every ~1.3 s); polling every 100 ms would
        # have sent 20 requests.
        assert received(zk_server, session) - before <= 3
        assert got == []
        released_at = time.monotonic()
        holders[1].release()
        thread.join(30)
        assert got, "the waiter was not let in"
        # Woken by the watch; the loop's own timer would have waited for an hour.
        assert got[0] - released_at < 5
    finally:
        thread.join(30)
        for lease in holders:
            lease.release()
    assert permit_nodes(zk, "semaphore", name) == []


def test_permit_waiters_that_time_out_leave_no_node(zk: str, name: str) -> None:
    sem = semaphore(name, limit=1, backend=zk, ttl=30)
    rw = rwlock(name, backend=zk)
    with sem as holder, rw.read(ttl=30) as reader:
        for side in (
            semaphore(name, limit=1, backend=zk, timeout=0.3),
            rw.write(timeout=0.3),
        ):
            started = time.monotonic()
            with pytest.raises(LockNotAcquired):
                side.acquire()
            assert time.monotonic() - started >= 0.3
        assert permit_nodes(zk, "semaphore", name) == [f"semaphore:{holder.owner}"]
        assert permit_nodes(zk, "read", name) == [f"read:{reader.owner}"]
        # A try-once with no room writes nothing at all.
        before = last_zxid_of(zk)
        for side in (semaphore(name, limit=1, backend=zk, timeout=0), rw.write(timeout=0)):
            with pytest.raises(LockNotAcquired):
                side.acquire()
        assert last_zxid_of(zk) == before
    assert permit_nodes(zk, "semaphore", name) == permit_nodes(zk, "read", name) == []


def test_force_release_of_one_semaphore_holder(zk: str, name: str) -> None:
    backend = get_backend(zk)
    sem = semaphore(name, limit=3, backend=zk, ttl=30, auto_renew=False)
    leases = [sem.acquire(timeout=0) for _ in range(3)]
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(sem.acquire(timeout=30)))
    thread.start()
    try:
        waiting.wait_for(lambda: len(permit_nodes(zk, "semaphore", name)) == 4, 30, "the waiter")
        holders = {info.owner: info for info in sem.holders()}
        assert set(holders) == {lease.owner for lease in leases}
        info = holders[leases[1].owner]
        assert (info.pid, info.host, info.ttl, info.fencing_token) == (
            os.getpid(), socket.gethostname(), 30, 0,
        )  # fmt: skip
        assert info.extra["kind"] == "semaphore" and info.extra["limit"] == 3
        assert info.extra["session"] == f"0x{backend.session_id():x}"
        assert info.waiters == 1 and len(info.extra["waiting"]) == 1
        # A stranger's owner, or a waiter's, evicts nothing and writes nothing.
        before = last_zxid_of(zk)
        assert backend.permit_force_release("semaphore", name, "nobody") == 0
        assert backend.permit_force_release("semaphore", name, info.extra["waiting"][0]) == 0
        assert last_zxid_of(zk) == before
        # The one holder named goes, the others stay; the waiter gets its permit.
        assert backend.permit_force_release("semaphore", name, leases[1].owner) == 1
        thread.join(30)
        assert got and got[0].held()
        with pytest.raises(LockLost):
            leases[1].extend()
        leases[0].extend()
        leases[2].extend()
        assert {i.owner for i in sem.holders()} == {
            leases[0].owner, leases[2].owner, got[0].owner,
        }  # fmt: skip
    finally:
        thread.join(30)
        for lease in [*leases, *got]:
            lease.release()


def test_readers_and_writers_in_arrival_order(zk: str, name: str) -> None:
    """R1 holds; W1, R2, W2, R3 queue in that order. R2 waits behind W1 though only
    a reader holds; then each release lets in exactly the next in line: W1 alone,
    R2 alone (R3 is behind W2), W2 alone, R3."""
    rw = rwlock(name, backend=zk)
    r1 = rw.read(ttl=30).acquire()
    order = ["write", "read", "write", "read"]
    leases: list[Any] = [None] * len(order)
    go = [threading.Event() for _ in order]
    errors: list[BaseException] = []

    def enter(index: int) -> None:
        try:
            with getattr(rw, order[index])(ttl=30, timeout=60) as lease:
                leases[index] = lease
                assert go[index].wait(60)
        except BaseException as exc:
            errors.append(exc)

    threads = []
    try:
        for index in range(len(order)):
            thread = threading.Thread(target=enter, args=(index,))
            thread.start()
            threads.append(thread)
            # Arrival order is the order of the nodes: the next starts once this queued.
            waiting.wait_for(
                lambda index=index: len(permit_nodes(zk, "read", name)) == index + 2, 30
            )
        assert [n.split(":")[0] for n in permit_nodes(zk, "read", name)] == ["read", *order]
        assert leases == [None] * 4
        assert [(h.owner, h.waiters) for h in rw.holders()] == [(r1.owner, 4)]
        tokens = []
        r1.release()
        for index, kind in enumerate(order):
            waiting.wait_for(lambda index=index: leases[index] is not None, 30, order[index])
            holders = rw.holders()
            assert [(h.owner, h.extra["kind"]) for h in holders] == [(leases[index].owner, kind)]
            assert all(lease is None for lease in leases[index + 1 :])
            if kind == "write":
                tokens.append(leases[index].fencing_token)
                # A writer's token is minted when it queues (as a lock's): the counter
                # already counts the writer queued behind this one.
                assert rw.fencing_counter() >= leases[index].fencing_token
                assert holders[0].fencing_token == leases[index].fencing_token
            else:
                assert leases[index].fencing_token == 0
            go[index].set()
        for thread in threads:
            thread.join(30)
        assert errors == []
        assert tokens == sorted(set(tokens))
        assert rw.fencing_counter() == tokens[-1]
    finally:
        r1.release()
        for event in go:
            event.set()
        for thread in threads:
            thread.join(30)
    assert permit_nodes(zk, "read", name) == []


def test_evicting_a_writer_moves_the_write_counter_in_the_same_step(zk: str, name: str) -> None:
    backend = get_backend(zk)
    rw = rwlock(name, backend=zk)
    assert rw.fencing_counter() == 0
    writer = rw.write(ttl=30, auto_renew=False).acquire()
    assert rw.fencing_counter() == writer.fencing_token
    before = last_zxid_of(zk)
    assert backend.permit_force_release("write", name, writer.owner) == 1
    assert last_zxid_of(zk) == before + 1  # one transaction: delete and counter
    assert rw.fencing_counter() > writer.fencing_token
    with rw.write(ttl=30, timeout=0) as again:
        assert again.fencing_token > rw.fencing_counter() - 1 > writer.fencing_token
    assert not writer.release()


def test_a_lost_session_loses_permits_too(
    settings: Any, zk_server: ZooKeeperServer, name: str
) -> None:

    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zk1": zk_config(zk_server.location, session_timeout=1),
    }
    lost: list[str] = []
    on_lost = lambda gone: lost.append(gone.kind)  # noqa: E731
    permit = semaphore(name, limit=2, backend="zk1", ttl=1, on_lost=on_lost).acquire()
    writer = rwlock(name, backend="zk1").write(ttl=1, on_lost=on_lost).acquire()
    # The server expires its session, deleting its nodes; the backend hears it.
    expire_session(get_backend("zk1"), zk_server.location)
    waiting.wait_for(lambda: not permit.held() and not writer.held(), 5, "the loss")
    # on_lost may come a moment after held() turns false (told on a notice thread).
    waiting.wait_for(lambda: len(lost) >= 2, 5, "both holders told")
    assert sorted(lost) == ["semaphore", "write"]
    with rwlock(name, backend="zk1").write(ttl=1, timeout=5) as again:
        assert again.fencing_token > writer.fencing_token


def fork_while_state_lock_held(location: str, out: str) -> None:
    """In a process of its own: a thread holds the backend's state lock when the
    process forks; the child handles a lost session (which takes that lock)."""
    from tests.zookeeper_workers import _setup

    _setup(location)
    from kazoo.protocol.states import KazooState

    from distlocks import lock

    with lock("fork-state", backend="zk", ttl=5, timeout=5):
        pass
    backend = get_backend("zk")
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with backend._state_lock:
            held.set()
            done.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: the holding thread is not here
        code = 1
        try:
            with lock("fork-state-child", backend="zk", ttl=5, timeout=5):
                pass
            handler = threading.Thread(target=backend._on_state, args=(KazooState.LOST,))
            handler.start()
            handler.join(10)
            code = 2 if handler.is_alive() else 0
        finally:
            os._exit(code)
    done.set()
    _, status = os.waitpid(pid, 0)
    Path(out).write_text(str(os.waitstatus_to_exitcode(status)))
    backend.close()


def test_forked_child_renews_the_state_lock(zk_server: ZooKeeperServer, tmp_path: Path) -> None:
    out = tmp_path / "exit"
    proc = multiprocessing.get_context("spawn").Process(
        target=fork_while_state_lock_held, args=(zk_server.location, str(out))
    )
    proc.start()
    proc.join(90)
    if proc.exitcode is None:
        proc.kill()
    assert proc.exitcode == 0
    # 2: the child's session-loss handler hung on the lock the parent's thread held.
    assert waiting.wait_for_text(out, 5, "the child's exit code") == "0"
