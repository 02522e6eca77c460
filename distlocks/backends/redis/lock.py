"""The Redis backend's lock recipe: acquire (at once or waiting, fair or not),
release, extend, keep, force release, leaving a fair queue, the fencing counter;
each operation one script of :mod:`.scripts`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from distlocks.backends.base import (
    AcquireResult,
    Holder,
)
from distlocks.backends.redis.calls import (
    _DRIVER_ERRORS,
    RedisCalls,
    Undo,
    _asend,
    _hiredis_pack,
    _HiredisPacker,
    _write_behind,
)
from distlocks.backends.redis.scripts import GIVE_BACK
from distlocks.exceptions import LockError
from redis.exceptions import ClusterCrossSlotError, NoScriptError

#: Numbers the release calls of this process, after a random id of the process. Not
#: the pid: worker containers on many hosts share pids (each one's first process is
#: pid 1) and, counting alike, would send the same ids for a queue marker's owner,
#: which every delivery of a message shares (a release of a lock it no longer held
#: would be told it released it). A forked child draws an id of its own.
_release_ids = itertools.count()
_process_id = [secrets.token_hex(8)]


def _redraw_process_id() -> None:
    _process_id[0] = secrets.token_hex(8)


os.register_at_fork(after_in_child=_redraw_process_id)


def release_id() -> str:
    """A new id for a release request, unique across processes and hosts."""
    return f"{_process_id[0]}.{next(_release_ids)}"


#: Acquire requests are numbered the same way: the id a grant records, which the
#: give-back of that request names (see _ATTEMPTS in :mod:`.scripts`).
request_id = release_id


def _extra_json(extra: Mapping[str, Any]) -> str:
    return json.dumps(dict(extra), separators=(",", ":")) if extra else "{}"


class RedisLocks(RedisCalls):
    """The contract's lock methods on the scripts of :mod:`.scripts`."""

    def _acquire_call(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> tuple[list[str], list[Any]]:
        keys = self.all_keys(name)
        # A waiter's registration outlives one blocking wait by a margin; it is
        # renewed at every attempt, and dropped by the others once it lapses.
        register_ms = round((min(wait, self.wait_chunk) + 1.0) * 1000) if wait > 0 else 0
        # The fair flag, then this request's id (what its give-back names).
        args = [
            owner, max(1, round(ttl * 1000)), name, holder.host, holder.pid, holder.thread,
            _extra_json(holder.extra), register_ms, f"{int(fair)}{request_id()}",
        ]  # fmt: skip
        return [keys.lock, keys.fence, keys.waiters, keys.queue], args

    # The calls of the acquire and release scripts without the listing index (as Redlock
    # runs them on its masters) and with it (this backend's own calls).

    def _indexed_acquire_call(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> tuple[list[str], list[Any]]:
        keys, args = self._acquire_call(name, owner, ttl, holder, wait, fair)
        return keys + self._index, args

    def _acquire_undo(self, name: str, owner: str, args: list[Any]) -> Undo:
        """The give-back of the acquire call ``args`` (see calls.Undo)."""
        return (self._lock_undo, name, owner, args[8][1:])

    @staticmethod
    def _acquire_result(reply: list[int]) -> AcquireResult:
        granted, token, remaining_ms = reply
        remaining = None if remaining_ms < 0 else remaining_ms / 1000
        return AcquireResult(bool(granted), int(token), remaining)

    def acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        keys, args = self._indexed_acquire_call(name, owner, ttl, holder, wait, fair)
        undo = self._acquire_undo(name, owner, args)
        try:
            reply = self._run_taking("acquire", keys, args, undo)
        except _DRIVER_ERRORS as exc:
            raise self._acquire_error(name, owner, exc, undo) from exc
        return self._acquire_result(reply)

    def _lock_undo(self, name: str, owner: str, rid: str) -> tuple[str, list[str], list[Any]]:
        """The give-back of the acquire request ``rid`` of ``name`` by ``owner``, left
        unanswered: what that request was granted, and only that (see GIVE_BACK)."""
        keys, args = self._release_call(name, owner)
        return GIVE_BACK, keys + self._index, [*args, name, rid]

    async def aacquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        wait: float = 0.0,
        fair: bool = False,
    ) -> AcquireResult:
        keys, args = self._indexed_acquire_call(name, owner, ttl, holder, wait, fair)
        undo = self._acquire_undo(name, owner, args)
        # A plain except, as in acquire(): a generator-based context manager per call
        # costs more than the rest of this method's Python work.
        try:
            reply = await self._arun("acquire", keys, args, undo)
        except _DRIVER_ERRORS as exc:
            raise self._acquire_error(name, owner, exc, undo) from exc
        except asyncio.CancelledError:
            # Cancelled (a timeout or task group around alock()) with the script maybe
            # sent: the server may still run it and grant a lock whose owner nobody
            # knows, to renew or release. Give it back, in the background so the
            # cancellation goes on at once (a give-back of a request never granted
            # changes nothing).
            self._give_back_elsewhere(undo, "after a cancelled acquire")
            raise
        return self._acquire_result(reply)

    def _release_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        k = self.all_keys(name)
        tombstone = k.lock.removesuffix("lock") + "released:" + owner
        return [k.lock, k.waiters, k.queue, k.signal, k.fence, tombstone], [owner, k.wake_prefix]

    def _indexed_release_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        # A release call of its own id: a retry of this very request (its reply lost)
        # sends the same id and is told it released the lock (see the RELEASE script).
        keys, args = self._release_call(name, owner)
        args += (name, release_id())
        if self._index:
            return keys + self._index, args
        return keys, args

    def release(self, name: str, owner: str) -> bool:
        keys, args = self._indexed_release_call(name, owner)
        try:
            return bool(self._run("release", keys, args))
        except _DRIVER_ERRORS as exc:
            raise self._error("release", name, exc) from exc

    async def arelease(self, name: str, owner: str) -> bool:
        keys, args = self._indexed_release_call(name, owner)
        try:
            return bool(await self._arun("release", keys, args))
        except _DRIVER_ERRORS as exc:
            raise self._error("release", name, exc) from exc
        except asyncio.CancelledError:
            # Cancelled (maybe still queued for a slot) with the lease's renewal already
            # stopped: without this the lock would stay held, by nobody, for its ttl.
            self._executor(False).submit(self.release_quietly, name, owner)
            raise

    def _extend_call(self, name: str, owner: str, ttl: float) -> tuple[list[str], list[Any]]:
        ttl_ms = max(1, round(ttl * 1000))
        k = self.all_keys(name)
        if self._index:
            return [k.lock, k.fence, *self._index], [owner, ttl_ms, name]
        return [k.lock, k.fence], [owner, ttl_ms]

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        try:
            return bool(self._run("extend", *self._extend_call(name, owner, ttl)))
        except _DRIVER_ERRORS as exc:
            raise self._error("extend", name, exc) from exc

    def keep(self, name: str, owner: str, ttl: float) -> bool:
        try:
            return bool(self._run("keep", *self._extend_call(name, owner, ttl)))
        except _DRIVER_ERRORS as exc:
            raise self._error("extend", name, exc) from exc

    #: Leases renewed by one script call of :meth:`extend_many` (about a millisecond of
    #: server time: the server serves nobody else meanwhile).
    EXTEND_BATCH = 500

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool | LockError]:
        if self.mode == "cluster":
            return self._extend_many_cluster(leases)
        results: list[bool | LockError] = []
        for start in range(0, len(leases), self.EXTEND_BATCH):
            chunk = leases[start : start + self.EXTEND_BATCH]
            keys = [self.all_keys(name).lock for name, _, _ in chunk]
            keys += [self.all_keys(name).fence for name, _, _ in chunk] + self._index
            args: list[Any] = []
            for name, owner, ttl in chunk:
                args += (owner, max(1, round(ttl * 1000)), name)
            try:
                replies = self._run("extend_many", keys, args)
            except ClusterCrossSlotError as exc:
                if self.listing_index or len(chunk) < 2:
                    error = self._error("renew", f"{len(chunk)} leases", exc)
                    error.__cause__ = exc
                    results += [error] * len(chunk)
                    continue
                # A cluster node named as one server, the index off: it serves each
                # lease's slot, but no script of two slots (it ran none of this one).
                # Each lease is renewed on its own, as on a cluster.
                results += [self._extend_one(name, owner, ttl) for name, owner, ttl in chunk]
                continue
            except _DRIVER_ERRORS as exc:
                error = self._error("renew", f"{len(chunk)} leases", exc)
                error.__cause__ = exc
                results += [error] * len(chunk)
                continue
            for (name, _, _), reply in zip(chunk, replies, strict=True):
                # -1: this lease's own key holds a value of another type (see the script).
                results.append(self._wrong_type_error(name) if reply == -1 else bool(reply))
        return results

    def _extend_one(self, name: str, owner: str, ttl: float) -> bool | LockError:
        try:
            return self.extend(name, owner, ttl)
        except LockError as exc:
            return exc

    def _wrong_type_error(self, name: str) -> LockError:
        """The renewal error of a lease of the batch whose key holds a value of another
        type than distlocks keeps there (EXTEND_MANY's -1), naming the key."""
        exc = redis.ResponseError(
            "WRONGTYPE Operation against a key holding the wrong kind of value"
        )
        error = self._error("renew", name, exc)
        error.__cause__ = exc
        return error

    def _extend_many_cluster(
        self, leases: Sequence[tuple[str, str, float]]
    ) -> list[bool | LockError]:
        """Keys of many slots cannot share a script: the leases are grouped by the node
        that serves their slot, and each node gets one pipeline of single-lease scripts
        (one round trip per node). A lease whose slot moved meanwhile (a redirect), or
        whose node lacks the script, is renewed on its own through the cluster client,
        which follows redirects and loads scripts."""
        client = self.client
        results: list[bool | LockError | None] = [None] * len(leases)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        try:
            for index, (name, _, _) in enumerate(leases):
                key = self.all_keys(name).lock
                node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
                by_node.setdefault(node.name, (node, []))[1].append(index)
        except _DRIVER_ERRORS:
            return super().extend_many(leases)  # no slot map: one call each
        script = self._scripts["extend"]
        for node, indexes in by_node.values():
            try:
                replies = self._extend_on_node(node, script.sha, leases, indexes)
                if any(isinstance(reply, NoScriptError) for reply in replies):
                    # The node's script cache was emptied: load it there, once more.
                    script.sha = node.redis_connection.script_load(script.script)
                    replies = self._extend_on_node(node, script.sha, leases, indexes)
            except _DRIVER_ERRORS:
                continue  # the node is unreachable: each lease tries on its own below
            for index, reply in zip(indexes, replies, strict=True):
                if not isinstance(reply, Exception):
                    results[index] = bool(reply)
        for index, result in enumerate(results):
            if result is None:
                name, owner, ttl = leases[index]
                try:
                    results[index] = self.extend(name, owner, ttl)
                except LockError as exc:
                    results[index] = exc
        return [result for result in results if result is not None]

    def _extend_on_node(
        self, node: Any, sha: str, leases: Sequence[tuple[str, str, float]], indexes: list[int]
    ) -> list[Any]:
        """One pipeline of EXTEND scripts on one cluster node: a reply (or the error met)
        per lease of ``indexes``."""
        pipe = node.redis_connection.pipeline(transaction=False)
        for index in indexes:
            name, owner, ttl = leases[index]
            k = self.all_keys(name)
            pipe.evalsha(sha, 2, k.lock, k.fence, owner, max(1, round(ttl * 1000)))
        return list(pipe.execute(raise_on_error=False))

    async def aextend(self, name: str, owner: str, ttl: float) -> bool:
        with self._errors("extend", name):
            return bool(await self._arun("extend", *self._extend_call(name, owner, ttl)))

    def force_release(self, name: str, token: int | None = None) -> bool:
        if token is None:
            # By the holder's token, read first: the script then does nothing when run
            # again (a request sent twice after its reply was lost), where "whoever
            # holds it" would also evict the waiter it had just woken.
            for _ in range(3):
                info = self.inspect(name)
                if info is None:
                    return False
                if self.force_release(name, info.fencing_token):
                    return True
            return False
        k = self.all_keys(name)
        with self._errors("force-release", name):
            return bool(
                self._run(
                    "force_release",
                    [k.lock, k.fence, k.waiters, k.queue, k.signal, *self._index],
                    [k.wake_prefix, "" if token is None else str(int(token)), name],
                )
            )

    def _wait_key(self, name: str, owner: str, fair: bool) -> str:
        keys = self.all_keys(name)
        return keys.wake_prefix + owner if fair else keys.signal

    def wait(self, name: str, timeout: float, *, owner: str = "", fair: bool = False) -> None:
        # BLPOP returns the moment a release pushes a wake-up (or at the timeout).
        seconds = min(timeout, self.wait_chunk)
        if seconds <= 0.001:
            return
        with self._errors("wait for", name):
            self.client.blpop([self._wait_key(name, owner, fair)], timeout=seconds)

    def wait_and_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        seconds: float,
        *,
        wait: float,
        fair: bool,
    ) -> AcquireResult | None:
        """:meth:`wait` then :meth:`acquire` in one round trip: the blocking pop and the
        acquire script pipelined on this thread's connection. Redis runs a client's
        commands in order, so the attempt runs on the server the moment the release
        wakes this waiter, without a trip back to the client in between (the lock is
        free for microseconds, not a round trip, at each hand-off).

        The wait is at most a third of ``ttl``: the lease is counted from the moment
        this call was sent. None where this cannot be done (a cluster, Sentinel, or a
        thread beyond the pinned ones): the caller then waits and acquires itself."""
        if not self._direct:
            return None
        seconds = min(seconds, self.wait_chunk, ttl / 3)
        conn = self._pinned() if seconds > 0.001 else None
        if conn is None:
            return None
        keys, args = self._indexed_acquire_call(name, owner, ttl, holder, wait, fair)
        undo = self._acquire_undo(name, owner, args)
        registered = self._scripts["acquire"]
        pop = ("BLPOP", self._wait_key(name, owner, fair), f"{seconds:.3f}")
        run = ("EVALSHA", registered.sha, len(keys), *keys, *args)
        pending = 2  # replies due: the wake-up's, the attempt's
        try:
            if _hiredis_pack is not None and type(conn._command_packer) is _HiredisPacker:
                conn.send_packed_command([_hiredis_pack(pop), _hiredis_pack(run)])
            else:
                conn.send_packed_command(conn.pack_commands([pop, run]))
            # The wake-up, or nothing at the end of the wait (or an error reply: the
            # attempt's reply is still due, and read all the same).
            wake_error = None
            try:
                conn.read_response(disconnect_on_error=False)
            except redis.ResponseError as exc:
                wake_error = exc
            pending = 1
            reply = conn.read_response(disconnect_on_error=False)
        except NoScriptError:
            # Both replies were read; the script is loaded by the plain path.
            return self.acquire(name, owner, ttl, holder, wait=wait, fair=fair)
        except redis.ConnectionError:
            # Broken while idle or while waiting: the caller's next plain acquire
            # reconnects (and is safe to repeat, by owner).
            conn.disconnect()
            return None
        except redis.TimeoutError as exc:
            # A reply is late: the attempt may still run. Give it back behind it.
            self._give_back_behind(conn, undo, pending)
            raise self._acquire_error(name, owner, exc, undo) from exc
        except _DRIVER_ERRORS as exc:
            # A reply may still be unread: this connection cannot be trusted any more.
            conn.disconnect()
            raise self._acquire_error(name, owner, exc, undo) from exc
        except BaseException:
            # Interrupted with the attempt sent: it may have taken the lock for an owner
            # nobody will release. Give it back, behind it, as after a timeout.
            self._give_back_behind(conn, undo, pending)
            raise
        result = self._acquire_result(reply)
        if wake_error is not None and not result.acquired:
            raise self._error("wait for", name, wake_error) from wake_error
        return result

    async def await_and_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        seconds: float,
        *,
        wait: float,
        fair: bool,
    ) -> AcquireResult | None:
        """:meth:`wait_and_acquire` for asyncio, on a connection of the loop's waiting
        share (when every one is taken by other waiters, it waits for one, then tries
        plainly). None where it cannot be done: the caller waits and acquires itself."""
        if not self._direct:
            return None
        seconds = min(seconds, self.wait_chunk, ttl / 3)
        if seconds <= 0.001:
            return None
        side = self._async_side()
        started = time.monotonic()
        try:
            await asyncio.wait_for(side.waits.acquire(), seconds)
        except TimeoutError:
            return await self.aacquire(name, owner, ttl, holder, wait=wait, fair=fair)
        conn = side.idle.pop() if side.idle else side.client.connection_pool.make_connection()
        try:
            left = max(0.01, seconds - (time.monotonic() - started))
            keys, args = self._indexed_acquire_call(name, owner, ttl, holder, wait, fair)
            undo = self._acquire_undo(name, owner, args)
            registered = side.scripts["acquire"]
            await _asend(
                conn,
                ("BLPOP", self._wait_key(name, owner, fair), f"{left:.3f}"),
                ("EVALSHA", registered.sha, len(keys), *keys, *args),
            )
            # The wake-up, or nothing at the end of the wait (or an error reply: the
            # attempt's reply is still due, and read all the same).
            wake_error = None
            try:
                await conn.read_response(disconnect_on_error=False)
            except redis.ResponseError as exc:
                wake_error = exc
            reply = await conn.read_response(disconnect_on_error=False)
        except NoScriptError:
            return await self.aacquire(name, owner, ttl, holder, wait=wait, fair=fair)
        except redis.ConnectionError:
            await conn.disconnect(nowait=True)
            return None  # the caller's plain acquire reconnects (safe to repeat, by owner)
        except redis.TimeoutError as exc:
            # A reply is late: the attempt may still run. Give it back behind it.
            _write_behind(conn, undo)
            await conn.disconnect(nowait=True)
            raise self._acquire_error(name, owner, exc, undo) from exc
        except _DRIVER_ERRORS as exc:
            await conn.disconnect(nowait=True)
            raise self._acquire_error(name, owner, exc, undo) from exc
        except BaseException:
            # Cancelled with the attempt sent: give back what it may have taken, behind
            # it on this connection, and on another in case this one is broken.
            _write_behind(conn, undo)
            await conn.disconnect(nowait=True)
            self._give_back_elsewhere(undo, "after a cancelled acquire")
            raise
        finally:
            side.idle.append(conn)
            side.waits.release()
        result = self._acquire_result(reply)
        if wake_error is not None and not result.acquired:
            raise self._error("wait for", name, wake_error) from wake_error
        return result

    async def await_release(
        self, name: str, timeout: float, *, owner: str = "", fair: bool = False
    ) -> None:
        seconds = min(timeout, self.wait_chunk)
        if seconds <= 0.001:
            return
        side = self._async_side()
        # A waiter needs a connection of the loop's waiting share; when they are all
        # taken by other waiters it waits for one instead (the caller tries again
        # after this wait either way, so it loses nothing but the early wake-up).
        started = time.monotonic()
        try:
            await asyncio.wait_for(side.waits.acquire(), seconds)
        except TimeoutError:
            return
        try:
            left = seconds - (time.monotonic() - started)
            if left <= 0.001:
                return
            with self._errors("wait for", name):
                await side.client.blpop([self._wait_key(name, owner, fair)], timeout=left)
        finally:
            side.waits.release()

    def _leave_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        k = self.all_keys(name)
        return [k.lock, k.waiters, k.queue, k.signal], [owner, k.wake_prefix]

    def leave_queue(self, name: str, owner: str) -> None:
        with self._errors("leave the queue of", name):
            self._run("leave", *self._leave_call(name, owner))

    async def aleave_queue(self, name: str, owner: str) -> None:
        with self._errors("leave the queue of", name):
            await self._arun("leave", *self._leave_call(name, owner))

    def fencing_counter(self, name: str) -> int:
        """The last fencing token issued for ``name`` (0 if none)."""
        with self._errors("read the fencing counter of", name):
            return int(self.client.get(self.all_keys(name).fence) or 0)
