"""Running the Redis backend's scripts: one EVALSHA per operation, on a
connection pinned to the thread (one server) or through the client, the asyncio
equivalent, and the driver's errors turned into LockError or
LockBackendUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import weakref
from collections.abc import Iterator
from typing import Any

import redis
from distlocks import process
from distlocks.backends.redis.background import _background, _start_drain
from distlocks.backends.redis.clients import (
    RedisClients,
    Undo,
    _AsyncSide,
    _hiredis_pack,
    _HiredisPacker,
    _undo_command,
    _write_behind,
)
from distlocks.backends.redis.config import cluster_node_error
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.logs import log_expected
from redis.exceptions import NoScriptError, RedisClusterException, SlotNotCoveredError

logger = logging.getLogger("distlocks.backends.redis")

_DRIVER_ERRORS = (redis.RedisError, RedisClusterException)

# A Redis Cluster node's refusals of a call (keys of two slots, or of another node's).
_CLUSTER_REPLIES = (redis.exceptions.ClusterCrossSlotError, redis.exceptions.AskError)

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


# What distlocks keeps at each key of a name (the key after the name's base, see
# .keys and .permits), for the error that names a key of the wrong type: the suffix,
# the type, and what it is.
_KEY_KINDS = {
    suffix: (kind, what.strip())
    for suffix, kind, what in (
        line.split(None, 2)
        for line in """
        lock          hash    the lock
        fence         string  the fencing counter
        waiters       zset    the waiters
        queue         zset    the fair queue
        signal        list    the wake-ups
        sem           zset    the semaphore's permits
        sem:info      hash    the semaphore's holders
        sem:waiters   zset    the semaphore's waiters
        sem:signal    list    the semaphore's wake-ups
        rw            zset    the read-write lock's leases
        rw:info       hash    the read-write lock's holders
        rw:writer     string  the read-write lock's writer
        rw:wwait      zset    the read-write lock's waiting writers
        rw:rwait      zset    the read-write lock's waiting readers
        rw:wsig       list    the writers' wake-ups
        rw:rsig       list    the readers' wake-ups
        rw:fence      string  the write fencing counter
        """.strip().splitlines()
    )
}


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


async def _aread(side: _AsyncSide, conn: Any, undo: Undo | None = None) -> Any:
    """``conn.read_response()``, its socket timeout kept by the loop's watch (one timer
    for every read of the loop) instead of an asyncio.timeout() per read: a reply late
    by the timeout has its connection aborted and raises redis.TimeoutError, as the
    client's own timeout does.

    With ``undo`` (the read of a request that may take something), a reply that does
    not come in time, or a read that is cancelled, has the give-back written on the
    same connection first: Redis serves one connection's commands in order, so the
    give-back runs after the request, however late that runs (or neither does)."""
    timeout = conn.socket_timeout
    if timeout is None and undo is None:
        return await conn.read_response()
    watch = side.watch
    if timeout is not None:
        watch.start(asyncio.get_running_loop(), conn, timeout, undo)
    try:
        # math.inf: no timer of the client's own (the watch keeps the timeout).
        if undo is None:
            reply = await conn.read_response(timeout=math.inf)
        else:
            reply = await conn.read_response(timeout=math.inf, disconnect_on_error=False)
    except redis.ConnectionError as exc:
        if watch.end(conn):
            where = conn._host_error() if hasattr(conn, "_host_error") else "the server"
            raise redis.TimeoutError(f"Timeout reading from {where}") from exc
        raise
    except redis.ResponseError:
        # An error reply (NOSCRIPT, a script's error) is raised after the read, with
        # the connection left as it was: one the watch aborted must be shut here.
        if watch.end(conn):
            await conn.disconnect(nowait=True)
        raise
    except BaseException:
        fired = watch.end(conn)
        if undo is not None:
            # Cancelled (or worse) while the reply was due: give back behind the
            # request (the watch did already if it fired), then close.
            if not fired:
                _write_behind(conn, undo)
            await conn.disconnect(nowait=True)
        elif fired:
            await conn.disconnect(nowait=True)
        raise
    if watch.end(conn):
        # Read in time, from what had come before the abort: the connection is done.
        await conn.disconnect(nowait=True)
        if undo is not None:
            # The watch wrote the give-back behind it: what this reply granted is
            # being given back, so the caller must not count on it.
            raise redis.TimeoutError("Timeout reading from the server (reply came late)")
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
        if self.mode == "server" and isinstance(exc, _CLUSTER_REPLIES):
            # On the error path only: a plain server's calls pay nothing for it.
            return cluster_node_error(self, action, name, exc, detail)
        if _is_unavailable(exc):
            return LockBackendUnavailable(self.alias, f"{action} {name!r} failed: {detail}")
        if "WRONGTYPE" in detail:
            detail += self._wrong_types(name)
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

    def _expected_types(self, name: str) -> dict[str, tuple[str, str]]:
        """The keys of ``name`` (lock, semaphore and read-write lock) and of the listing
        index, each with the type distlocks keeps there and what it is."""
        base = self.all_keys(name).lock.removesuffix(":lock")
        found = {f"{base}:{suffix}": kind for suffix, kind in _KEY_KINDS.items()}
        if self.listing_index:
            found[self.index_key] = ("hash", "the listing index")
            found[self.index_permits_key] = ("set", "the listing index's permits set")
        return found

    def _wrong_types(self, name: str) -> str:
        """For a WRONGTYPE error about ``name``: which of its keys holds a value of
        another type than distlocks keeps there, and what to do (a round trip, on the
        error path only). Key names, never a credential."""
        expected = self._expected_types(name)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in expected:
                pipe.type(key)
            found = [_text(kind) for kind in pipe.execute()]
        except _DRIVER_ERRORS:
            return " (could not read the keys' types to say which one)"
        wrong = [
            f"key {key!r} holds a {kind} where distlocks keeps a {want} ({what})"
            for (key, (want, what)), kind in zip(expected.items(), found, strict=True)
            if kind not in ("none", want)
        ]
        if not wrong:
            return " (a key of this name holds a value of another type than distlocks keeps)"
        return (
            "; " + "; ".join(wrong) + ": something other than distlocks wrote it. Delete it "
            "(DEL) and try again; this call changed nothing it reports."
        )

    def _acquire_error(
        self, name: str, owner: str, exc: Exception, undo: Undo | None = None
    ) -> LockError:
        """:meth:`_error` for an acquire, which a timeout leaves in doubt. ``undo``: the
        give-back of that very request (see :meth:`_give_back_elsewhere`); without it
        (a caller that has none), the owner's release."""
        if isinstance(exc, redis.TimeoutError):
            # The script may have run and only the reply was lost: give the lock
            # back rather than leave it held by a lease nobody knows about. In the
            # background, so the caller hears of the outage after one timeout.
            if undo is not None:
                self._give_back_elsewhere(undo, "after a reply that did not come")
            else:
                _background(self.release_quietly, name, owner)
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

    def _run_direct(
        self, conn: Any, script: Any, keys: list[str], args: list[Any], undo: Undo | None = None
    ) -> Any:
        """One EVALSHA on ``conn``: what ``client.evalsha`` does, without the pool
        checkout, retry wrapper and event hooks around it (a sixth of a round trip on a
        local server). Same rules: a connection broken while idle (a server restart) is
        reconnected and the call made once more; a timeout is not retried; a script
        missing from the server's cache is loaded again. ``script``: the name of one of
        the backend's scripts, or a registered script (``sha`` and ``script``).

        With ``undo``, a request that may take something: if its reply does not come
        (a timeout, an interrupt), the give-back is sent behind it on ``conn``, which
        is then no longer the caller's (see :meth:`_give_back_behind`)."""
        registered = self._scripts[script] if type(script) is str else script
        reconnected = reloaded = sent = False
        while True:
            try:
                command = ("EVALSHA", registered.sha, len(keys), *keys, *args)
                if _hiredis_pack is not None and type(conn._command_packer) is _HiredisPacker:
                    # What the connection's packer does, minus its per-argument scan for
                    # bytearrays (our arguments are str and int).
                    conn.send_packed_command([_hiredis_pack(command)])
                else:
                    conn.send_command(*command)
                if undo is None:
                    return conn.read_response()
                sent = True
                return conn.read_response(disconnect_on_error=False)
            except NoScriptError:
                if reloaded:
                    raise
                reloaded = True
                conn.send_command("SCRIPT", "LOAD", registered.script)
                registered.sha = _text(conn.read_response())
            except redis.TimeoutError:
                if undo is None:
                    conn.disconnect()
                else:
                    self._give_back_behind(conn, undo, 1)
                raise
            except redis.ConnectionError:
                conn.disconnect()
                if reconnected:
                    if sent:
                        self._give_back_elsewhere(undo)
                    raise
                reconnected = True
            except redis.ResponseError:
                raise  # a reply: the connection is fine
            except BaseException:
                # Interrupted (KeyboardInterrupt, a signal handler's exception) with the
                # request maybe sent: give back behind it, as after a timeout.
                if undo is not None:
                    self._give_back_behind(conn, undo, 1)
                raise

    def _give_back_elsewhere(
        self, undo: Undo | None, why: str = "after a broken connection"
    ) -> None:
        """Give back, in the background and on another connection, what a request may
        have taken: after its connection broke (its retry broke too: the server may
        still run what it had received, but nothing written on the broken connection
        can follow it any more), and after a timeout or a cancellation, besides the
        give-back sent behind it. The give-back names its request (see GIVE_BACK), so
        it takes back nothing another request was granted, whenever it runs."""
        if undo is not None:
            _background(self._give_back_now, undo, why)

    def _give_back_now(self, undo: Undo, why: str) -> None:
        command = _undo_command(undo)
        key = str(command[3] if len(command) > 3 else "")
        try:
            with self._errors("give back", key):
                self.client.execute_command(*command)
        except Exception as exc:
            log_expected(logger, exc, "Could not give back %s (key %r) on backend %r; it "
                         "lapses with its ttl", why, key, self.alias)  # fmt: skip

    def _give_back_behind(self, conn: Any, undo: Undo, pending: int) -> None:
        """Give back what the request(s) on ``conn`` whose ``pending`` replies have not
        come may take, by sending the give-back on ``conn`` itself, behind them.

        Redis serves one connection's commands in the order they came: the give-back
        runs after the request, however late that runs (a stalled server, a slow
        proxy, a packet being sent again), so it cannot find nothing and then be
        overtaken by a grant to an owner who walked away, as a give-back sent on
        another connection can. If the server drops the connection first, it runs
        neither or the request alone: that is why a connection that broke after the
        request was written gets its give-back on a new connection (the caller's own
        clean-up), the best left to do, since nothing written on the old one can
        follow the request any more.

        ``conn`` is then a thread's: it reads the replies due (up to GIVE_BACK_DRAIN),
        closes the connection and gives it back. A pinned connection is unpinned from
        this thread first (its next call pins a new one); one checked out of the pool
        (:meth:`_run_taking`) is handed to that thread by the checkout, once it is done
        with it (``_distlocks_drain``), so it goes back to the pool only once."""
        if getattr(conn, "_sock", True) is None:
            return  # closed already (a write that timed out): sending would reconnect
        try:
            conn.send_packed_command(conn.pack_command(*_undo_command(undo)), check_health=False)
        except Exception as exc:
            # Broken meanwhile: the caller's clean-up gives back on a new connection.
            logger.debug("Could not send the give-back behind the request: %s", exc)
            conn.disconnect()
            return
        slot = getattr(self._local, "slot", None)
        if slot is None or slot.conn is not conn:
            conn._distlocks_drain = pending + 1  # a checkout: _run_taking starts it
            return
        # Unpinned: the drain keeps the slot, which gives the connection back to its
        # pool when it goes (as at the end of a thread).
        self._local.slot = None
        _start_drain(conn, pending + 1, slot, None)

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

    def _run_taking(self, script: Any, keys: list[str], args: list[Any], undo: Undo) -> Any:
        """:meth:`_run` for a request that may take something (``script``: a name, as
        for :meth:`_run`, or a registered script): on a connection in hand, so that a
        reply that does not come has its give-back ``undo`` sent behind the request on
        the same connection (:meth:`_give_back_behind`). This thread's pinned
        connection, or one checked out of the pool (Sentinel, threads beyond the pinned
        ones); a cluster's requests go through its client, which follows redirects."""
        client = self.client
        registered = self._scripts[script] if type(script) is str else script
        if self._direct:
            conn = self._pinned()
            if conn is not None:
                return self._run_direct(conn, registered, keys, args, undo)
        if self.mode == "cluster":
            return _evalsha(client, registered, keys, args)
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            return self._run_direct(conn, registered, keys, args, undo)
        except redis.ResponseError as exc:
            if not self._demoted(exc):
                raise
        finally:
            replies = getattr(conn, "_distlocks_drain", 0)
            if replies:
                # A give-back went behind the request: its replies are read, and the
                # connection given back, by a thread of its own.
                conn._distlocks_drain = 0
                _start_drain(conn, replies, None, pool)
            else:
                pool.release(conn)
        # As in _run: a primary demoted by a failover wrote nothing; ask again.
        pool.disconnect(inuse_connections=False)
        return _evalsha(client, registered, keys, args)

    async def _arun_direct(
        self,
        side: _AsyncSide,
        script: str,
        keys: list[str],
        args: list[Any],
        undo: Undo | None = None,
    ) -> Any:
        """:meth:`_run_direct` for asyncio: one EVALSHA on an idle connection of the
        loop's client (at most ``calls`` of them are in use at once), without the
        client's checkout, retry wrapper, per-send task and argument encoding pass."""
        registered = side.scripts[script]
        conn = side.idle.pop() if side.idle else side.client.connection_pool.make_connection()
        try:
            reconnected = reloaded = sent = False
            while True:
                try:
                    await _asend(conn, ("EVALSHA", registered.sha, len(keys), *keys, *args))
                    sent = undo is not None
                    return await _aread(side, conn, undo)
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
                        if sent:
                            self._give_back_elsewhere(undo)
                        raise
                    reconnected = True
        finally:
            # Whatever happened, the connection is either ready for the next call or
            # disconnected (it reconnects on its next use).
            side.idle.append(conn)

    async def _arun(
        self, script: str, keys: list[str], args: list[Any], undo: Undo | None = None
    ) -> Any:
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
                return await self._arun_direct(side, script, keys, args, undo)
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
