"""The ZooKeeper workloads and implementations: distlocks against kazoo's ``Lock``.

Opt-in (``python -m bench --only zk-cycle --only zk-handoff``): they need Debian's
ZooKeeper jars and a JRE, which ``make bench`` does not install (``make test`` does,
as root). The runner starts a throwaway standalone server for the run
(:class:`~distlocks.testing.zookeeper_server.ZooKeeperServer`, on a free loopback
port) and skips these workloads, saying what to install, where it cannot.

Every implementation has a session of its own on that server, asking for the same
session timeout (30 s, the lease length of every workload). Lock names become
znodes under a prefix of each implementation's own, so they never meet.
"""

from __future__ import annotations

import logging
import math
import posixpath
import socket
import threading
import time
import urllib.parse
from typing import Any

from bench.base import BenchError, Env, Implementation, RunOptions, implementation, workload
from bench.implementations import BackendLevel
from bench.postgres import DistlocksPg
from bench.workloads import Cycle, HandOff

FAMILY = "zookeeper"
#: The workloads the ZooKeeper implementations take part in (and nothing else does).
ZK_WORKLOADS = frozenset({"zk-cycle", "zk-handoff"})

# kazoo logs every reconnection and retried call; none of that belongs in the timings.
logging.getLogger("kazoo").setLevel(logging.ERROR)


def missing() -> str:
    """Why the ZooKeeper workloads cannot run here ("" when they can)."""
    from importlib.util import find_spec

    if find_spec("kazoo") is None:
        return "kazoo is not installed: pip install 'distlocks[zookeeper]'"
    from distlocks.testing.zookeeper_server import zookeeper_missing

    return zookeeper_missing()


def start_server() -> Any:
    """A throwaway standalone ZooKeeper for the run; ``close()`` it afterwards.

    Not ``durable``: like the Redis (no persistence) and PostgreSQL (``fsync=off``)
    servers of the benchmark, it does not sync its log before replying, so the
    figures show what the clients and recipes cost, not the disk.
    """
    from distlocks.testing.zookeeper_server import ZooKeeperServer

    return ZooKeeperServer().start()


def server_version(location: str) -> str:
    """The server's version from its ``srvr`` answer ("3.8.0"), or ""."""
    if not location:
        return ""
    host, _, port = location.partition("/")[0].split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2) as sock:
            sock.sendall(b"srvr")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
    except OSError as exc:
        return f"unknown ({type(exc).__name__})"
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("Zookeeper version:"):
            return line.split(":", 1)[1].strip().split("-", 1)[0].split(",", 1)[0]
    return ""


class KazooImplementation(Implementation):
    """Base of the implementations that drive a kazoo client of their own."""

    family = FAMILY
    servers = frozenset({"zookeeper"})
    distribution = "kazoo"
    workloads = ZK_WORKLOADS
    #: Where this implementation's lock znodes live.
    root: str = ""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from kazoo.client import KazooClient

        from bench.settings import ZOOKEEPER_SESSION_TIMEOUT

        self.client = KazooClient(hosts=env.zookeeper, timeout=ZOOKEEPER_SESSION_TIMEOUT)
        self.client.start(timeout=10)

    def path(self, name: str) -> str:
        return f"{self.root}/{urllib.parse.quote(name, safe='')}"

    def close(self) -> None:
        self.client.stop()
        self.client.close()


@implementation
class ZkFloor(KazooImplementation):
    """kazoo's client with nothing on top: create an ephemeral sequential node, list the
    children, delete the node.

    The least a correct ZooKeeper lock needs: the lowest sequence number holds, the
    node goes with its session. A waiter watches only its predecessor (``exists`` with
    a watch). Lock znodes are created once per name (a persistent parent), then
    reused. No fencing token, no holder data.
    """

    name = "zk-floor"
    label = "raw create(ephemeral, sequence) + get_children + delete"
    role = "floor"
    root = "/bench-zk-floor"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self._ensured: set[str] = set()

    def _enqueue(self, name: str) -> tuple[str, str]:
        parent = self.path(name)
        if parent not in self._ensured:
            self.client.ensure_path(parent)
            self._ensured.add(parent)
        return parent, self.client.create(f"{parent}/c-", ephemeral=True, sequence=True)

    def try_acquire(self, name: str, ttl: float) -> str | None:
        parent, node = self._enqueue(name)
        # Every child is "c-" and ten digits: the lowest name has the lowest number.
        if min(self.client.get_children(parent)) == posixpath.basename(node):
            return node
        self.client.delete(node)
        return None

    def release(self, handle: str) -> None:
        self.client.delete(handle)

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        parent, node = self._enqueue(name)
        mine = posixpath.basename(node)
        while True:
            children = sorted(self.client.get_children(parent))
            if mine not in children:
                raise BenchError(f"{self.name}: the node {node} vanished while waiting")
            index = children.index(mine)
            if index == 0:
                return node
            left = deadline - time.monotonic()
            if left <= 0:
                self.client.delete(node)
                return None
            gone = threading.Event()
            predecessor = f"{parent}/{children[index - 1]}"
            # Only the predecessor is watched: its deletion wakes this waiter alone.
            stat = self.client.exists(predecessor, watch=lambda _event, gone=gone: gone.set())
            if stat is not None:
                gone.wait(left)


@implementation
class DistlocksZk(DistlocksPg):
    """distlocks through its public API on ZooKeeper: ``with lock(name, backend="zk", ...):``."""

    name = "distlocks-zk"
    label = 'distlocks lock(backend="zk") (public API)'
    family = FAMILY
    servers = frozenset({"zookeeper"})
    workloads = ZK_WORKLOADS
    alias = "zk"


@implementation
class DistlocksZkWait(DistlocksZk):
    """distlocks' public API with a timeout: ``with lock(name, backend="zk", timeout=5):``.

    A caller that may wait queues at once (the multi-op), then lists the contenders;
    one that tries once (``timeout=0``, the ``distlocks-zk`` row) lists them first, so as
    to write nothing when the lock is busy, and queues only if the fence node is still
    as listed (a conditional multi-op), which tells it holds with no second listing.
    Three requests a cycle on a free lock either way.
    """

    name = "distlocks-zk-wait"
    label = 'distlocks lock(backend="zk", timeout=5) (public API)'
    reference = False
    workloads = frozenset({"zk-cycle"})
    wait = 5.0

    def cycle(self, name: str, ttl: float) -> None:
        with self._lock(name, backend=self.alias, ttl=ttl, timeout=self.wait):
            pass

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        return self.acquire_blocking(name, ttl, self.wait)


@implementation
class DistlocksZkBackend(BackendLevel):
    """distlocks one layer down: ``ZooKeeperBackend.acquire`` / ``release``, no Lease.

    The gap to ``zk-floor`` is the backend's recipe (the fencing multi-op, the holder
    data, the checks); the gap to ``distlocks-zk`` is the public API layer.
    """

    name = "distlocks-zk-backend"
    label = "distlocks ZooKeeperBackend.acquire/release"
    role = "distlocks"
    family = FAMILY
    servers = frozenset({"zookeeper"})
    distribution = "distlocks"
    # Blocking is the public API's job; measuring it here would repeat the distlocks row.
    workloads = frozenset({"zk-cycle"})

    backend_alias = "zk"


@implementation
class KazooLock(KazooImplementation):
    """kazoo's own recipe, ``kazoo.recipe.lock.Lock`` (``client.Lock(path)``).

    A ``Lock`` object per acquisition, as application code creates one per lock name:
    each first ``acquire()`` makes sure the lock's znode exists. Waiters watch their
    predecessor. No fencing token.
    """

    name = "kazoo"
    label = "kazoo recipe.lock.Lock"
    role = "peer"
    root = "/bench-kazoo"

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        lock = self.client.Lock(self.path(name))
        return lock if lock.acquire(blocking=False) else None

    def release(self, handle: Any) -> None:
        handle.release()

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> Any | None:
        from kazoo.exceptions import LockTimeout

        lock = self.client.Lock(self.path(name))
        try:
            return lock if lock.acquire(timeout=timeout) else None
        except LockTimeout:
            return None


@workload
class ZkCycle(Cycle):
    """The ``cycle`` workload on ZooKeeper."""

    family = FAMILY
    name = "zk-cycle"
    title = "Uncontended acquire + release cycle"
    description = (
        "One thread takes and releases the same free lock on a standalone ZooKeeper in a "
        "loop (try once, no wait). The time of each acquire+release pair is one sample."
    )


@workload
class ZkHandOff(HandOff):
    """The ``handoff`` workload on ZooKeeper."""

    family = FAMILY
    name = "zk-handoff"
    title = "Contended hand-off latency, 16 waiters"

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        if not options.quick:
            # Four times the hand-offs of `handoff`, in twice the rounds: ZooKeeper's
            # hand-offs vary more from round to round, and 300 in 6 rounds left the
            # comparison with kazoo's Lock to chance (0.89x to 1.06x its time in three
            # runs of the same code on one day).
            total = options.iterations // 5 if options.iterations else 1200
            self.rounds = 12
            self.per_round = max(1, math.ceil(total / self.rounds))

    description = (
        "17 threads share one lock on a standalone ZooKeeper: one holds it, 16 wait in the "
        "library's own blocking acquire (a watch on a znode). The holder keeps it 1 ms, "
        "releases, and does not queue again until another thread has it. A sample is the "
        "time from the start of release() to the return of the next acquire."
    )
