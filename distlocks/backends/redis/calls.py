"""Running the Redis backend's scripts: one EVALSHA per operation, on a
connection pinned to the thread (one server) or through the client, the asyncio
equivalent, and the driver's errors turned into LockError or
LockBackendUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import redis
from distlocks import process
from distlocks.backends.redis.clients import RedisClients, _AsyncSide
from distlocks.exceptions import LockBackendUnavailable, LockError
from redis.exceptions import NoScriptError, RedisClusterException, SlotNotCoveredError

_DRIVER_ERRORS = (redis.RedisError, RedisClusterException)

_UNAVAILABLE = (
    redis.ConnectionError,  # includes "no primary found" from Sentinel
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.ClusterError,  # the cluster is down, or redirections ran out
    redis.exceptions.TryAgainError,
    SlotNotCoveredError,
)
# Replies of a server that cannot take writes now: a replica (e.g. a primary demoted by
# a failover), one still loading its data, one cut off from its primary, a cluster
# that lost a slot. Inside a script Redis 6 reports them as script errors.
_UNAVAILABLE_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")


def _is_unavailable(exc: Exception) -> bool:
    """True for errors that mean "the server cannot serve this now", not a bug."""
    if isinstance(exc, _UNAVAILABLE):
        return True
    if isinstance(exc, RedisClusterException):
        # No node could be reached to learn the slot map (but not: a node answered
        # that it is no cluster node), or the nodes disagree on it (a failover).
        unreachable = isinstance(exc.__cause__, redis.ConnectionError | redis.TimeoutError)
        return unreachable or "could not agree" in str(exc)
    return any(word in str(exc) for word in _UNAVAILABLE_REPLIES)


_hiredis_pack: Any = None
_HiredisPacker: Any = None
with contextlib.suppress(ImportError):  # redis-py without hiredis packs for itself
    from hiredis import pack_command as _hiredis_pack

    from redis.connection import HiredisRespSerializer as _HiredisPacker


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _unpinned(backend_ref: Any, pool: Any) -> None:
    """A pinned connection went back to ``pool`` (its thread ended)."""
    backend = backend_ref()
    client = None if backend is None else backend._client
    if client is not None and client.connection_pool is pool:
        with backend._client_lock:
            backend._pinned_count -= 1


async def _asend(conn: Any, *commands: tuple[Any, ...]) -> None:
    """Send ``commands`` (pipelined) on an asyncio connection: written at once to the
    socket, and waited for (up to the socket timeout) only if the kernel did not take
    it all."""
    writer = getattr(conn, "_writer", None)
    encoder = conn.encoder
    if (
        writer is None
        or _hiredis_pack is None
        or conn.health_check_interval
        or (encoder.encoding, encoder.encoding_errors) != ("utf-8", "strict")
    ):
        await conn.send_packed_command(conn.pack_commands(commands))
        return
    if not conn.is_connected:
        await conn.connect()
        writer = conn._writer
    writer.writelines([_hiredis_pack(command) for command in commands])
    if writer.transport.get_write_buffer_size():
        try:
            await asyncio.wait_for(writer.drain(), conn.socket_timeout)
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await conn.disconnect(nowait=True)
            raise redis.ConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            # Cancelled with the command partly written: the rest would still go out
            # and the connection's next call would read this command's reply as its own.
            await conn.disconnect(nowait=True)
            raise


async def _aread(side: _AsyncSide, conn: Any) -> Any:
    """``conn.read_response()``, its socket timeout kept by the loop's watch (one timer
    for every read of the loop) instead of an asyncio.timeout() per read: a reply late
    by the timeout has its connection aborted and raises redis.TimeoutError, as the
    client's own timeout does."""
    timeout = conn.socket_timeout
    if timeout is None:
        return await conn.read_response()
    watch = side.watch
    watch.start(asyncio.get_running_loop(), conn, timeout)
    try:
        # math.inf: no timer of the client's own (the watch keeps the timeout).
        reply = await conn.read_response(timeout=math.inf)
    except redis.ConnectionError as exc:
        if watch.end(conn):
            where = conn._host_error() if hasattr(conn, "_host_error") else "the server"
            raise redis.TimeoutError(f"Timeout reading from {where}") from exc
        raise
    except BaseException:
        # An error reply (NOSCRIPT, a script's error) is raised after the read, with
        # the connection left as it was: one the watch aborted must be shut here.
        if watch.end(conn):
            await conn.disconnect(nowait=True)
        raise
    if watch.end(conn):
        # Read in time, from what had come before the abort: the connection is done.
        await conn.disconnect(nowait=True)
    return reply


class _Pinned:
    """A connection taken from a backend's pool for one thread, for as long as that
    thread lives: given back to the pool when the thread's local storage goes."""

    __slots__ = ("__weakref__", "conn", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.conn = pool.get_connection()

    def __del__(self, _suppress: Any = contextlib.suppress) -> None:
        # At thread exit or interpreter shutdown; at shutdown the module's globals may
        # already be None, hence contextlib.suppress kept as a default argument.
        if self.pool is not None:
            with _suppress(Exception):
                self.pool.release(self.conn)


def _evalsha(client: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
    """Run a registered script on ``client``: one EVALSHA, as calling the script object
    does, without the per-call work it spends on pipelines and argument copies."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        # The server's script cache was emptied (a restart, a failover, SCRIPT FLUSH):
        # load the script and run it again.
        script.sha = client.script_load(script.script)
        return client.evalsha(script.sha, len(keys), *keys, *args)


class RedisCalls(RedisClients):
    """How a script is run and how its failures are reported."""

    @contextlib.contextmanager
    def _errors(self, action: str, name: str) -> Iterator[None]:
        try:
            yield
        except _DRIVER_ERRORS as exc:
            raise self._error(action, name, exc) from exc

    def _error(self, action: str, name: str, exc: Exception) -> LockError:
        """The LockError to raise (from ``exc``) for a driver error during ``action``.

        The acquire, release and extend paths call it from a plain ``except``: a
        generator-based context manager costs more than the rest of their Python work."""
        detail = f"{type(exc).__name__}: {exc}"
        if _is_unavailable(exc):
            return LockBackendUnavailable(self.alias, f"{action} {name!r} failed: {detail}")
        if "Cluster mode is not enabled" in detail:
            detail += " (LOCATION redis+cluster:// names a server that is not a cluster node)"
        elif isinstance(exc, redis.exceptions.InvalidResponse):
            # An answer in another protocol: the port of a web server, etcd, a proxy, or
            # a TLS server asked in plain text.
            detail += (
                " (the server at LOCATION answers as if it is not a Redis server: check its"
                " host and port, and use rediss:// for a server that requires TLS)"
            )
        return LockError(
            f"Redis error while trying to {action} lock {name!r} on backend "
            f"{self.alias!r}: {detail}"
        )

    def _acquire_error(self, name: str, owner: str, exc: Exception) -> LockError:
        """:meth:`_error` for an acquire, which a timeout leaves in doubt."""
        if isinstance(exc, redis.TimeoutError):
            # The script may have run and only the reply was lost: give the lock
            # back rather than leave it held by a lease nobody knows about. In the
            # background, so the caller hears of the outage after one timeout.
            threading.Thread(target=self.release_quietly, args=(name, owner), daemon=True).start()
        return self._error("acquire", name, exc)

    def _demoted(self, exc: redis.ResponseError) -> bool:
        """A Sentinel-managed connection still open to a primary that a failover made
        a replica: the script's first write fails, and Redis reports it as a script
        error, which the client does not take for a lost primary."""
        return self.mode == "sentinel" and "READONLY" in str(exc)

    #: Threads that get a connection of their own (per backend); the others share the
    #: pool through the client, as before.
    MAX_PINNED = 64

    def _pinned(self) -> Any:
        """This thread's own connection from the pool, or None (more threads than
        :attr:`MAX_PINNED` already have one)."""
        slot = getattr(self._local, "slot", None)
        pool = self.client.connection_pool
        if slot is not None:
            if slot.pool is pool and slot.conn.pid == process.pid:
                return slot.conn
            # The backend was closed since (a new pool), or this is a forked child,
            # where the parent's connection must not be used nor given back.
            if slot.conn.pid != process.pid:
                slot.pool = None
            self._local.slot = None
        with self._client_lock:
            if self._pinned_count >= self.MAX_PINNED:
                return None
            self._pinned_count += 1
        try:
            slot = _Pinned(pool)
        except BaseException:
            with self._client_lock:
                self._pinned_count -= 1
            raise
        weakref.finalize(slot, _unpinned, weakref.ref(self), pool)
        self._local.slot = slot
        return slot.conn

    def _run_direct(self, conn: Any, script: str, keys: list[str], args: list[Any]) -> Any:
        """One EVALSHA on ``conn``: what ``client.evalsha`` does, without the pool
        checkout, retry wrapper and event hooks around it (a sixth of a round trip on a
        local server). Same rules: a connection broken while idle (a server restart) is
        reconnected and the call made once more; a timeout is not retried; a script
        missing from the server's cache is loaded again."""
        registered = self._scripts[script]
        reconnected = reloaded = False
        while True:
            try:
                command = ("EVALSHA", registered.sha, len(keys), *keys, *args)
                if _hiredis_pack is not None and type(conn._command_packer) is _HiredisPacker:
                    # What the connection's packer does, minus its per-argument scan for
                    # bytearrays (our arguments are str and int).
                    conn.send_packed_command([_hiredis_pack(command)])
                else:
                    conn.send_command(*command)
                return conn.read_response()
            except NoScriptError:
                if reloaded:
                    raise
                reloaded = True
                conn.send_command("SCRIPT", "LOAD", registered.script)
                registered.sha = _text(conn.read_response())
            except redis.TimeoutError:
                conn.disconnect()
                raise
            except redis.ConnectionError:
                conn.disconnect()
                if reconnected:
                    raise
                reconnected = True

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        if self._direct:
            conn = self._pinned()
            if conn is not None:
                return self._run_direct(conn, script, keys, args)
        client = self.client
        try:
            return _evalsha(client, self._scripts[script], keys, args)
        except redis.ResponseError as exc:
            if not self._demoted(exc):
                raise
        # Close the idle connections (the failed one is among them): new ones ask the
        # Sentinels for the primary. Then try once more: the script wrote nothing on
        # the replica, and every script may safely run twice.
        client.connection_pool.disconnect(inuse_connections=False)
        return self._scripts[script](keys=keys, args=args, client=client)

    async def _arun_direct(
        self, side: _AsyncSide, script: str, keys: list[str], args: list[Any]
    ) -> Any:
        """:meth:`_run_direct` for asyncio: one EVALSHA on an idle connection of the
        loop's client (at most ``calls`` of them are in use at once), without the
        client's checkout, retry wrapper, per-send task and argument encoding pass."""
        registered = side.scripts[script]
        conn = side.idle.pop() if side.idle else side.client.connection_pool.make_connection()
        try:
            reconnected = reloaded = False
            while True:
                try:
                    await _asend(conn, ("EVALSHA", registered.sha, len(keys), *keys, *args))
                    return await _aread(side, conn)
                except NoScriptError:
                    if reloaded:
                        raise
                    reloaded = True
                    await _asend(conn, ("SCRIPT", "LOAD", registered.script))
                    registered.sha = _text(await conn.read_response())
                except redis.TimeoutError:
                    await conn.disconnect(nowait=True)
                    raise
                except redis.ConnectionError:
                    await conn.disconnect(nowait=True)
                    if reconnected:
                        raise
                    reconnected = True
        finally:
            # Whatever happened, the connection is either ready for the next call or
            # disconnected (it reconnects on its next use).
            side.idle.append(conn)

    async def _arun(self, script: str, keys: list[str], args: list[Any]) -> Any:
        side = self._async_side()
        # One of the loop's connections for a quick call: at once when one is free, else in
        # turn behind the coroutines already waiting for one. Taken and given back here,
        # not in an async context manager: building and driving one per call cost more
        # Python work than the rest of this method.
        slots = side.calls
        if slots.locked():
            await self._queue_for_slot(slots)
        else:
            await slots.acquire()
        try:
            if self._direct:
                return await self._arun_direct(side, script, keys, args)
            client, scripts = side.client, side.scripts
            try:
                return await scripts[script](keys=keys, args=args, client=client)
            except redis.ResponseError as exc:
                if not self._demoted(exc):
                    raise
            await client.connection_pool.disconnect(inuse_connections=False)
            return await scripts[script](keys=keys, args=args, client=client)
        finally:
            slots.release()
