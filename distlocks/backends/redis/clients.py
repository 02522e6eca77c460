"""The redis-py clients of the Redis backend: one server, a Redis Cluster or a
Sentinel-managed primary, built lazily with the backend's timeouts, and one asyncio
client per event loop with its limits on connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect as pyinspect
import math
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from distlocks.backends.redis.config import Location, parse_location
from distlocks.backends.redis.keys import Keys, RedisKeys
from distlocks.backends.redis.scripts import SCRIPTS
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import SlotNotCoveredError
from redis.retry import Retry

_hiredis_pack: Any = None
_HiredisPacker: Any = None
with contextlib.suppress(ImportError):  # redis-py without hiredis packs for itself
    from hiredis import pack_command as _hiredis_pack

    from redis.connection import HiredisRespSerializer as _HiredisPacker  # noqa: F401

#: What undoes a request that may take something (a lock, a permit) if it is left
#: unanswered: a function and its arguments, called only then, which returns the Lua
#: of the give-back with its keys and arguments. A tuple, not a closure: the request's
#: hot path builds one per call, and nothing more.
Undo = tuple[Any, ...]


def _undo_command(undo: Undo) -> tuple[Any, ...]:
    """The EVAL of the give-back ``undo`` names: the script in full, so it runs even on
    a server whose script cache lost it."""
    lua, keys, args = undo[0](*undo[1:])
    return ("EVAL", lua, len(keys), *keys, *args)


def _write_behind(conn: Any, undo: Undo) -> bool:
    """Write the give-back ``undo`` on the asyncio connection ``conn`` behind the
    request whose reply is still due (without waiting); False if it is closed."""
    writer = getattr(conn, "_writer", None)
    if writer is None or writer.transport is None or writer.transport.is_closing():
        return False
    command = _undo_command(undo)
    if _hiredis_pack is not None:
        writer.write(_hiredis_pack(command))
    else:
        writer.writelines(conn.pack_command(*command))
    return True


# Connection settings the asyncio clients accept, copied from the sync pool.
_ASYNC_KWARGS = frozenset(pyinspect.signature(redis.asyncio.Redis.__init__).parameters) - {
    "self",
    "connection_pool",
    "retry",
    "single_connection_client",
}
_ASYNC_CLUSTER_KWARGS = frozenset(
    pyinspect.signature(redis.asyncio.cluster.RedisCluster.__init__).parameters
) - {"self", "host", "port", "startup_nodes", "retry", "cluster_error_retry_attempts"}


class _ClusterClient(redis.cluster.RedisCluster):
    """A cluster client that retries (once, after refreshing its slot map) when a node
    refused or dropped the connection, or the cluster reported itself down during a
    failover; never after a timeout, so a node that does not answer is reported after
    one socket timeout, as a single server would be."""

    # Narrower than the base class's tuple (no TimeoutError), hence the ignore.
    ERRORS_ALLOW_RETRY = (  # type: ignore[assignment]
        redis.ConnectionError,
        redis.exceptions.ClusterDownError,
        SlotNotCoveredError,
    )


class _AsyncClusterClient(redis.asyncio.cluster.RedisCluster):
    """:class:`_ClusterClient` for asyncio."""

    ERRORS_ALLOW_RETRY = _ClusterClient.ERRORS_ALLOW_RETRY  # type: ignore[assignment]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        # Read the slot map before routing. Some redis-py releases (8.1) choose the
        # node of a keyed command before their lazy first read of the map, and after
        # the client closed itself to re-read it: with no map the command goes to a
        # random node. Every EVALSHA then costs a MOVED, and enough of them make the
        # client close the connections its other coroutines are using.
        if self.nodes_manager.default_node is None:
            await self.initialize()
        return await super().execute_command(*args, **kwargs)


class _AsyncSentinelReconnect:
    """Reconnect a Sentinel-managed asyncio connection through the Sentinels.

    After a dropped connection, the asyncio client's retry reconnects from inside
    ``send_packed_command``, to the address it had before: after a failover, the old
    primary. Connecting first the Sentinel-managed way asks the Sentinels for the
    current primary, as the synchronous client does."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:  # type: ignore[attr-defined]
            await self.connect()  # type: ignore[attr-defined]
        await super().send_packed_command(command, check_health)  # type: ignore[misc]


class _AsyncSentinelConnection(
    _AsyncSentinelReconnect, redis.asyncio.sentinel.SentinelManagedConnection
):
    pass


class _AsyncSentinelSSLConnection(
    _AsyncSentinelReconnect, redis.asyncio.sentinel.SentinelManagedSSLConnection
):
    pass


class _ReadWatch:
    """The socket timeout of one event loop's direct calls, kept with one timer for all
    of them: a reply that has not come by its deadline has its connection aborted,
    and the reader then raises redis.TimeoutError (see calls._aread).

    redis.asyncio keeps it with an asyncio.timeout() around every read: a timer made,
    pushed on the loop's heap and cancelled per round trip, several microseconds of a
    call's Python work. Here a read costs a dict entry; the timer fires at the earliest
    deadline of the reads under way (or of a read that ended since, and then finds
    nothing to do), and is set again for the next one."""

    __slots__ = ("deadlines", "expired", "timer", "when")

    def __init__(self) -> None:
        #: id(connection) -> (deadline on the loop's clock, connection, what gives back
        #: the request if its reply is late), reads under way.
        self.deadlines: dict[int, tuple[float, Any, Undo | None]] = {}
        #: id() of connections aborted for being late, until their reader has seen it.
        self.expired: set[int] = set()
        self.timer: asyncio.TimerHandle | None = None
        #: When the timer fires (inf when there is none).
        self.when = math.inf

    def start(
        self, loop: asyncio.AbstractEventLoop, conn: Any, timeout: float, undo: Undo | None = None
    ) -> None:
        deadline = loop.time() + timeout
        self.deadlines[id(conn)] = (deadline, conn, undo)
        if deadline < self.when:
            # The first read, or one due before the timer (a shorter timeout than the
            # reads under way: the connections' timeouts need not all be the same).
            if self.timer is not None:
                self.timer.cancel()
            self.when = deadline
            self.timer = loop.call_at(deadline, self._check, loop)

    def end(self, conn: Any) -> bool:
        """The read on ``conn`` is over; True if the watch aborted its connection."""
        key = id(conn)
        self.deadlines.pop(key, None)
        if key in self.expired:
            self.expired.discard(key)
            return True
        return False

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer, self.when = None, math.inf
        now = loop.time()
        for key, (deadline, conn, undo) in list(self.deadlines.items()):
            if deadline <= now:
                del self.deadlines[key]
                self.expired.add(key)
                writer = getattr(conn, "_writer", None)
                if writer is None:
                    continue
                if undo is not None and _write_behind(conn, undo):
                    # The give-back goes out behind the request, then the end of the
                    # stream: close(), which sends what is written first, not abort().
                    writer.transport.close()
                else:
                    # The reader sees the end of the stream after what it already
                    # received: a reply that came just in time is still read.
                    writer.transport.abort()
        if self.deadlines:
            self.when = min(deadline for deadline, _, _ in self.deadlines.values())
            self.timer = loop.call_at(self.when, self._check, loop)


@dataclasses.dataclass
class _AsyncSide:
    """One event loop's redis.asyncio client, its scripts, and how many of its
    connections quick calls and blocking waits may use at once."""

    client: Any
    scripts: dict[str, Any]
    calls: asyncio.Semaphore
    waits: asyncio.Semaphore
    #: Idle connections of the direct path (one server), most recently used last.
    idle: list[Any] = dataclasses.field(default_factory=list)
    #: The socket timeout of the direct path's reads.
    watch: _ReadWatch = dataclasses.field(default_factory=_ReadWatch)


class RedisClients(RedisKeys):
    """The backend's state and its clients; no request is sent before first use."""

    #: Defaults chosen so that an unreachable server is reported within about a
    #: second instead of hanging: requests are small and answered in microseconds.
    DEFAULT_SOCKET_TIMEOUT = 1.0
    DEFAULT_CONNECT_TIMEOUT = 1.0

    def __init__(self, alias: str, config: Mapping[str, Any]) -> None:
        super().__init__(alias, config)
        self.key_prefix: str = self.options.get("key_prefix", conf.KEY_PREFIX)
        location = config.get("LOCATION")
        self.location = parse_location(location) if location else Location("server")
        #: "server" (one Redis server), "cluster" or "sentinel".
        self.mode = self.location.mode
        # Any: a redis.Redis, or a RedisCluster (which has no connection_pool).
        self._client: Any = None
        self._sentinel: redis.sentinel.Sentinel | None = None
        self._client_lock = threading.Lock()
        self._scripts: dict[str, Any] = {}
        self._keys_cache: dict[str, Keys] = {}
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncSide] = (
            weakref.WeakKeyDictionary()
        )
        # One server (not a cluster or Sentinel): each thread calls on a connection of
        # its own, kept between calls (see _run).
        self._direct = self.mode == "server"
        self._local = threading.local()
        self._pinned_count = 0
        #: The listing index (see :meth:`rebuild_listing_index`): on by default, off on
        #: a cluster (a script cannot touch the index and a lock's slot together) or
        #: with ``OPTIONS["listing_index"] = False``.
        self.listing_index: bool = self.mode != "cluster" and self.options.get(
            "listing_index", True
        )
        base = f"{self.key_prefix}:listing"
        #: The index hash (lock name -> entry), the set of the permits' info hashes,
        #: and the marker that the index was built. No lock key can be one of them:
        #: those all have a brace right after the prefix.
        self.index_key, self.index_permits_key, self.index_marker_key = (
            base,
            f"{base}:permits",
            f"{base}:built",
        )
        self._index: list[str] = [base] if self.listing_index else []

    def _timeouts(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.options.get("socket_timeout", self.DEFAULT_SOCKET_TIMEOUT),
            "socket_connect_timeout": self.options.get(
                "socket_connect_timeout", self.DEFAULT_CONNECT_TIMEOUT
            ),
            # One immediate retry on a broken pooled connection (e.g. after a server
            # restart); never on a timeout, so an unreachable server fails fast.
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        }

    def _server_kwargs(self) -> dict[str, Any]:
        """Connection options for cluster nodes or Sentinel-managed servers, with the
        precedence of a single server's: the URL's options, then ``client_kwargs``,
        then our timeouts."""
        return {
            **self._timeouts(),
            **dict(self.options.get("client_kwargs", {})),
            **self.location.kwargs,
        }

    def _sentinel_kwargs(self, retry: Any) -> dict[str, Any]:
        """Options for the connections to the Sentinels themselves."""
        timeouts = self._timeouts()
        return {
            "socket_timeout": timeouts["socket_timeout"],
            "socket_connect_timeout": timeouts["socket_connect_timeout"],
            # Sentinels are asked one after the other: a dead one costs one attempt.
            "retry": retry,
            **dict(self.options.get("sentinel_kwargs") or {}),
        }

    def _cluster_client(self) -> redis.cluster.RedisCluster:
        kwargs = self._server_kwargs()
        # The cluster client retries itself (with a fresh slot map); its node
        # connections never do.
        retry = kwargs.pop("retry")
        # A primary that is down without a replica to take over must not stop the
        # client from using the slots of the others.
        kwargs.setdefault("require_full_coverage", False)
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in self.location.nodes]
        return _ClusterClient(startup_nodes=nodes, retry=retry, **kwargs)

    def _sentinel_client(self) -> redis.Redis:
        # Each new connection asks the Sentinels for the primary's address; an open
        # connection is used as long as it works (one EVALSHA per operation).
        self._sentinel = redis.sentinel.Sentinel(
            list(self.location.nodes), sentinel_kwargs=self._sentinel_kwargs(Retry(NoBackoff(), 0))
        )
        return self._sentinel.master_for(
            self.location.service, db=self.location.db, **self._server_kwargs()
        )

    def _build_client(self) -> Any:
        if self.mode == "cluster":
            return self._cluster_client()
        if self.mode == "sentinel":
            return self._sentinel_client()
        extra = dict(self.options.get("client_kwargs", {}))
        if "LOCATION" in self.config:
            return redis.Redis.from_url(self.config["LOCATION"], **{**self._timeouts(), **extra})
        try:
            from django_redis import get_redis_connection
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS_BACKENDS[{self.alias!r}] uses CACHE, which needs django-redis: "
                f"pip install 'distlocks[redis]'."
            ) from exc
        # Same server and credentials as the cache, but a pool of our own, so that the
        # cache's timeouts (often none) cannot make a lock call hang.
        cache_pool = get_redis_connection(self.config["CACHE"]).connection_pool
        kwargs = dict(cache_pool.connection_kwargs)
        timeouts = self._timeouts()
        for key in ("socket_timeout", "socket_connect_timeout"):
            if kwargs.get(key) is None:
                kwargs[key] = timeouts[key]
        kwargs["retry"] = timeouts["retry"]
        kwargs.update(extra)
        pool = redis.ConnectionPool(connection_class=cache_pool.connection_class, **kwargs)
        return redis.Redis(connection_pool=pool)

    @property
    def client(self) -> Any:
        """The redis-py client: a ``redis.Redis``, or a ``RedisCluster`` for a cluster.

        Created on first use; no I/O before that. A cluster client reads the slot map
        when it is created, so that first use can fail as any request can."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    client = self._build_client()
                    self._scripts = {
                        key: client.register_script(lua) for key, lua in SCRIPTS.items()
                    }
                    self._client = client
        return self._client

    def _new_async_client(self) -> Any:
        retry = AsyncRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        if self.mode == "cluster":
            kwargs = self._server_kwargs()
            kwargs.pop("retry")
            kwargs.setdefault("require_full_coverage", False)
            nodes = [
                redis.asyncio.cluster.ClusterNode(host, port) for host, port in self.location.nodes
            ]
            kwargs["max_connections"] = self.async_pool_size  # per node
            return _AsyncClusterClient(
                startup_nodes=nodes,
                retry=AsyncRetry(NoBackoff(), 1),
                **{k: v for k, v in kwargs.items() if k in _ASYNC_CLUSTER_KWARGS},
            )
        if self.mode == "sentinel":
            sentinel = redis.asyncio.sentinel.Sentinel(
                list(self.location.nodes),
                sentinel_kwargs=self._sentinel_kwargs(AsyncRetry(NoBackoff(), 0)),
            )
            kwargs = {k: v for k, v in self._server_kwargs().items() if k in _ASYNC_KWARGS}
            kwargs["max_connections"] = self.async_pool_size
            ssl = kwargs.pop("ssl", False)
            return sentinel.master_for(
                self.location.service,
                redis_class=redis.asyncio.Redis,
                connection_class=_AsyncSentinelSSLConnection if ssl else _AsyncSentinelConnection,
                retry=retry,
                **kwargs,
            )
        pool = self.client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        kwargs.pop("retry", None)
        if "path" in kwargs:
            kwargs["unix_socket_path"] = kwargs.pop("path")
        if issubclass(pool.connection_class, redis.SSLConnection):
            kwargs["ssl"] = True
        # Keep our timeouts; take the rest (address, credentials, TLS) from the
        # synchronous pool, whatever LOCATION or CACHE built it from.
        kwargs["max_connections"] = self.async_pool_size
        return redis.asyncio.Redis(
            **{k: v for k, v in kwargs.items() if k in _ASYNC_KWARGS}, retry=retry
        )

    def _async_side(self) -> _AsyncSide:
        """The redis.asyncio client of the running event loop (clients are per loop),
        with its scripts and the two limits on its connections."""
        loop = asyncio.get_running_loop()
        found = self._async_clients.get(loop)
        if found is None:
            aclient = self._new_async_client()
            scripts = {key: aclient.register_script(lua) for key, lua in SCRIPTS.items()}
            calls, waits = self._async_limits()
            found = _AsyncSide(aclient, scripts, asyncio.Semaphore(calls), asyncio.Semaphore(waits))
            with self._client_lock:
                # Let go of the clients of loops closed since (asyncio.run() per call):
                # their connections hold their loop, so its weak key never would, and
                # each would keep a connection open for the life of the process.
                for closed in [old for old in self._async_clients if old.is_closed()]:
                    del self._async_clients[closed]
                self._async_clients[loop] = found
        return found

    def _async_client(self) -> tuple[Any, dict[str, Any]]:
        side = self._async_side()
        return side.client, side.scripts

    #: Connections of one event loop's client (``OPTIONS["async_pool_size"]``): a third
    #: for blocking waits, the rest for the calls that answer at once (acquire, release,
    #: renewal), so that waiters can never take every connection from the holders.
    DEFAULT_ASYNC_POOL_SIZE = 96
    #: Longest wait of a call for a free connection of its loop before it fails.
    ASYNC_QUEUE_TIMEOUT = 30.0

    def _async_limits(self) -> tuple[int, int]:
        size = self.async_pool_size
        waits = max(1, size // 3)
        return max(1, size - waits), waits

    @property
    def async_pool_size(self) -> int:
        return int(self.options.get("async_pool_size", self.DEFAULT_ASYNC_POOL_SIZE))

    async def _queue_for_slot(self, slots: asyncio.Semaphore) -> None:
        """Wait for a call slot behind the coroutines already waiting for one; fail
        after ASYNC_QUEUE_TIMEOUT rather than queue for ever."""
        try:
            await asyncio.wait_for(slots.acquire(), self.ASYNC_QUEUE_TIMEOUT)
        except TimeoutError:
            raise LockBackendUnavailable(
                self.alias,
                f"no free connection within {self.ASYNC_QUEUE_TIMEOUT:g} s: "
                f"{self._async_limits()[0]} calls of this event loop were in flight "
                f"the whole time. Raise OPTIONS['async_pool_size'] (now "
                f"{self.async_pool_size}) or run fewer coroutines against this backend.",
            ) from None

    def close(self) -> None:
        client, self._client = self._client, None
        with self._client_lock:
            self._pinned_count = 0  # pinned connections of the old pool are not reused
        if client is not None:
            client.close()
            if self.mode != "cluster":
                client.connection_pool.disconnect()
        if self._sentinel is not None:
            self._sentinel.close()
            self._sentinel = None
        self._async_clients.clear()

    @property
    def wait_chunk(self) -> float:
        """Longest single blocking wait, kept under the socket timeout actually in force
        (which a URL query, client_kwargs or a shared cache may have set)."""
        if self.mode == "cluster":
            # From the settings: building a cluster client already talks to the nodes.
            timeout = self._server_kwargs().get("socket_timeout")
        else:
            timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout is None:
            timeout = 5.0 / 0.8
        return max(0.01, min(5.0, 0.8 * float(timeout)))
