"""Session mode's lock recipe: a session-level advisory lock on a pooled connection
that stays pinned to the lease until release.

The server frees the lock when that connection ends (a crashed holder frees it as
soon as the server sees the connection close); a renewal confirms the connection is
alive and still holds it. Waiting is the server's own queue (``pg_advisory_lock``
under a ``lock_timeout``): one round trip, waiters served in arrival order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import psycopg
import psycopg.errors

from distlocks.backends.base import AcquireResult, Holder
from distlocks.backends.postgres import sql
from distlocks.backends.postgres.connections import NAMES_CACHED, Held, PooledBackend, encode
from distlocks.backends.postgres.keys import key_parts
from distlocks.backends.postgres.pool import Connection, NoAnswer
from distlocks.backends.postgres.wire import Statement, is_true, to_int
from distlocks.exceptions import LockError

# The lock cycle's statements, on the fast path of :mod:`.wire` (prepared once per
# connection). The unlock statements by the text a Held names (permits' too).
ACQUIRE_TRY = Statement("distlocks_acquire_try", sql.ACQUIRE_TRY, to_int)
UNLOCK = Statement("distlocks_unlock", sql.UNLOCK, is_true)
UNLOCKS = {
    sql.UNLOCK: UNLOCK,
    sql.READ_UNLOCK: Statement("distlocks_read_unlock", sql.READ_UNLOCK, is_true),
}
HOLDS = Statement("distlocks_holds", sql.HOLDS, is_true, positional=("classid", "objid"))
# Where each of the acquire try's parameters goes ($n order; sql.py's statement may
# change, its parameters' names may not: a name missing fails here, at import).
_KEY, _NAME, _OWNER, _HOST, _PID, _THREAD, _TTL, _EXTRA = map(
    ACQUIRE_TRY.params.index, ("key", "name", "owner", "host", "pid", "thread", "ttl", "extra")
)


#: A try that was not granted (immutable: one for all).
NOT_ACQUIRED = AcquireResult(False, 0, None)
#: The ttls' text as sent (a caller uses one or a few), bounded.
TTLS_CACHED = 64
_TTLS: dict[float, bytes] = {}


class Named(NamedTuple):
    """A lock name's advisory key and guard key, with the fast path's encodings of
    what its statements send (computed once per name: the SHA-256 keys, their text,
    the name's UTF-8)."""

    key: int
    guard: int
    #: The acquire try's parameters with the name's own filled in.
    try_args: list[bytes | None]
    unlock_args: list[bytes | None]
    holds_args: list[bytes | None]
    #: ``[(holder, ttl, parameters)]``: the last try's parameters but its owner, for
    #: the next try by the same holder with the same ttl (one item, swapped whole,
    #: so that a thread reading it never sees one holder's ttl with another's row).
    last: list[tuple[Holder, float, list[bytes | None]] | None]


class SessionLocks(PooledBackend):
    """Session-mode locks (the contract's dispatch is in :mod:`.base`)."""

    def _named(self, name: str) -> Named:
        """``name``'s keys and encodings (cached; never for a name that fails)."""
        named: Named | None = self._names.get(name)
        if named is None:
            key, guard = self.key(name), self._guard(name)
            classid, objid = key_parts(key)
            by_param = {
                "key": encode(key),
                "guard": encode(guard),
                "reader": b"0",
                "classid": encode(classid),
                "objid": encode(objid),
            }
            template: list[bytes | None] = [None] * len(ACQUIRE_TRY.params)
            template[_KEY], template[_NAME] = by_param["key"], encode(name)
            named = Named(
                key,
                guard,
                template,
                [by_param[param] for param in UNLOCK.params],
                [by_param[param] for param in HOLDS.params],
                [None],
            )
            if len(self._names) >= NAMES_CACHED:
                self._names.clear()  # a bound, not an LRU: a name costs one encoding again
            self._names[name] = named
        return named

    def _try_args(self, named: Named, owner: str, ttl: float, holder: Holder) -> list[bytes | None]:
        """The acquire try's parameters, encoded (UTF-8), in ``$n`` order: the name's
        from its template, the holder's from its cache, the rest encoded now."""
        plain = type(owner) is str and "\x00" not in owner
        last = named.last[0]
        if (
            last is not None
            and last[0] is holder
            and plain
            and type(ttl) is float
            and last[1] == ttl
            and not holder.extra  # read at each try: a holder's extra may change in place
        ):
            # The usual try: the same thread locking the same name with the same ttl
            # again. Equal floats other than 0.0 and -0.0 (no ttl) have one text.
            args = last[2].copy()
            args[_OWNER] = owner.encode()
            return args
        # The caches' hits read here (the helpers fill them): calls cost more than that.
        cached = self._holders.get(id(holder))
        if cached is None or cached[0] is not holder:
            cached = self._holder_columns(holder)
        _, host, pid, thread = cached
        args = named.try_args.copy()
        args[_OWNER] = owner.encode() if plain else encode(owner)
        args[_HOST] = host
        args[_PID] = pid
        args[_THREAD] = thread
        ttl_text = _TTLS.get(ttl) if type(ttl) is float else None
        if ttl_text is None:
            ttl_text = encode(ttl)
            if type(ttl) is float and len(_TTLS) < TTLS_CACHED:
                _TTLS[ttl] = ttl_text
        args[_TTL] = ttl_text
        if holder.extra:
            args[_EXTRA] = encode(json.dumps(dict(holder.extra)))
        else:
            args[_EXTRA] = b"{}"
            if type(ttl) is float and ttl:
                named.last[0] = (holder, ttl, args.copy())
        return args

    @property
    def pool_size(self) -> int:
        """How many connections the pool may hold (without creating the pool)."""
        pool = self._pool
        if pool is not None:
            return pool.max_size
        size: int = self.options.get("pool_size", self.DEFAULT_POOL_SIZE)
        return size

    def check_lock_many(self, names: Sequence[str], enclosing: Collection[str]) -> None:
        """Refuse a ``lock_many()`` that can never succeed, before it takes anything.

        Each session-mode lease pins a pooled connection until it ends, so ``names``
        need ``len(names)`` connections at once, beside those pinned by ``enclosing``
        (the owners of the caller's own leases whose ``with`` blocks enclose the call:
        only the caller can give them back, and it is busy waiting). Such a call would
        otherwise wait out its whole timeout for a connection that cannot come. A call
        that fits waits as before: other threads' leases end. Transaction mode takes
        every lock on Django's connection, so it has no such bound."""
        if self.mode != "session":
            return
        size, count = self.pool_size, len(names)
        if count > size:
            raise ValueError(
                f"lock_many() of {count} names on backend {self.alias!r} can never succeed: "
                f"in session mode each lock held pins a pooled connection of its own, and "
                f"OPTIONS['pool_size'] is {size}. Raise OPTIONS['pool_size'] to at least "
                f"{count} (within the server's max_connections), take fewer names at once, "
                f"or use an alias with OPTIONS['mode'] = 'transaction' (every lock on "
                f"Django's own connection, inside transaction.atomic())."
            )
        if not enclosing:
            return
        with self._held_lock:
            mine = sum(1 for owner in set(enclosing) if owner in self._held)
        if count + mine > size:
            raise LockError(
                f"lock_many() of {count} names on backend {self.alias!r} can never succeed "
                f"here: {mine} lease(s) of this alias whose with blocks enclose the call "
                f"pin {mine} of its {size} pooled connections (OPTIONS['pool_size']), and "
                f"only this caller can give them back. Raise OPTIONS['pool_size'] to at "
                f"least {count + mine}, or take these names with the enclosing ones in one "
                f"lock_many(), or use an alias with OPTIONS['mode'] = 'transaction'."
            )

    def _acquire_session(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float
    ) -> AcquireResult:
        """A session lock pinned to a pooled connection until release."""
        again = self._held.get(owner)  # one dict read: atomic, no lock needed
        if again is not None:  # a retried acquire by the same owner
            # Only if its session still holds the lock: a force release ends that
            # session, and the lease must then be taken anew (with a new token), never
            # handed back as it was.
            if self._extend_session(owner):
                return AcquireResult(True, again.token, ttl)
            self._forget_session(owner)
        deadline = time.monotonic() + wait if wait > 0 else 0.0
        try:
            named = self._names.get(name)
            if named is None:
                named = self._named(name)
            args = self._try_args(named, owner, ttl, holder)
        except psycopg.Error as exc:  # a name or holder psycopg's dumpers refuse (a NUL)
            raise self._driver_error("acquire", name, exc) from exc
        request = (name, owner, ttl, holder, args)
        conn = self._checkout(name, wait)
        ours = True  # conn is checked out (to put back or discard)
        try:
            try:
                if wait <= 0 and conn.utf8:  # a try, encoded ahead: the usual acquire
                    token = conn.value_encoded(ACQUIRE_TRY, args)
                else:
                    token = self._lock_statement(conn, request, deadline, wait)
            except psycopg.OperationalError as exc:
                if isinstance(exc, NoAnswer):
                    raise
                # The connection died under the statement (ended by the server just
                # before): any lock it took ended with it, so one more try on a new
                # connection is safe.
                ours = False
                self._discard(conn)
                conn = self._checkout(name, max(0.0, deadline - time.monotonic()))
                ours = True
                token = self._lock_statement(conn, request, deadline, wait)
        except BaseException as exc:
            # Whatever happened, this connection must not keep a lock nobody owns.
            if ours:
                self._discard(conn)
            if isinstance(exc, psycopg.Error):  # as _mapped_errors() maps it (no context)
                raise self._mapped_error("acquire", name, exc) from exc
            raise
        if token is None:
            self.pool.put(conn)
            return NOT_ACQUIRED
        # Positional (the fields' order): cheaper than keywords, once per lease.
        held = Held(conn, named.key, token, "lock", sql.UNLOCK, 0, named.guard, "", named)
        with self._held_lock:
            self._held[owner] = held
        # The lease is confirmed by renewal pings; locally valid for one ttl.
        return AcquireResult(True, token, ttl)

    def _lock_statement(
        self, conn: Connection, request: tuple[Any, ...], deadline: float, wait: float
    ) -> int | None:
        """Run the acquire statement: a wait in the server's queue for the rest of the
        caller's budget, or one try. The token, or None when not granted."""
        name, owner, ttl, holder, args = request
        if wait > 0:
            left = deadline - time.monotonic()
            if left > 0:
                params = self._params(name, owner, ttl, holder)
                return self._acquire_blocking(conn, params, left)
        token: int | None
        if conn.utf8:
            token = conn.value_encoded(ACQUIRE_TRY, args)
        else:  # encoded for this connection's own encoding instead
            token = conn.value(ACQUIRE_TRY, self._params(name, owner, ttl, holder))
        return token

    def _release_session(self, name: str, owner: str) -> bool:
        with self._held_lock:
            held = self._held.pop(owner, None)
            if held is None:
                return False
            if held.busy:
                held.abandoned = True
        if held.abandoned:
            # A renewal's call is in flight on the lease's connection, perhaps stuck on
            # a server that does not answer; the release does not wait for it (see
            # Lease._release), and the connection cannot carry the unlock meanwhile. Its
            # session is ended instead: the socket shut down, the server frees the lock
            # as soon as it sees the connection end (as for a crashed holder), and the
            # call in flight fails at once; its thread closes the connection.
            held.conn.interrupt()
            return True
        # Unlocked on the lease's own connection, which then goes back to the pool.
        try:
            unlocked: bool
            if held.named is not None and held.conn.utf8:
                unlocked = held.conn.value_encoded(UNLOCK, held.named.unlock_args)
            else:
                params = {"key": held.key, "reader": held.reader, "guard": held.guard}
                unlocked = held.conn.value(UNLOCKS[held.unlock], params)
        except psycopg.Error:
            # The connection is gone, and the server freed the lock with it.
            self._discard(held.conn)
            return False
        except BaseException:
            # Interrupted (Ctrl-C, a Celery soft time limit): the lease is no one's
            # any more and whether the unlock ran is unknown. Closed, which frees the
            # lock if it did not, rather than lost to the pool with the lock on it.
            self._discard(held.conn)
            raise
        pool = self._pool
        (self.pool if pool is None else pool).put(held.conn)
        return unlocked

    def _extend_session(self, owner: str) -> bool:
        """Confirm the lease: its connection is alive and still holds the lock."""
        with self._held_lock:
            held = self._held.get(owner)
            if held is None:
                return False
            held.busy = True  # a release meanwhile ends the session instead (see above)
        try:
            holds: bool
            if held.named is not None and held.conn.utf8:
                holds = held.conn.value_encoded(HOLDS, held.named.holds_args)
            else:
                classid, objid = key_parts(held.key)
                holds = held.conn.value(HOLDS, {"classid": classid, "objid": objid})
        except BaseException as exc:
            failed = isinstance(exc, psycopg.Error)
            with self._held_lock:
                held.busy = False
                if failed and self._held.get(owner) is held:
                    del self._held[owner]
            if failed or held.abandoned:
                # Terminated or cut off (or ended by a release meanwhile): a session
                # lock does not outlive its connection.
                self._discard(held.conn)
            if failed:
                return False
            raise
        with self._held_lock:
            held.busy = False
        if held.abandoned:
            # Released while this call was in flight: its session was ended, and the
            # connection is this call's to close (once).
            self._discard(held.conn)
            return False
        return holds

    def _forget_session(self, owner: str) -> None:
        """Drop ``owner``'s lease found no longer held; its connection goes back to the
        pool only if it is alive (the lock it held is gone either way)."""
        with self._held_lock:
            held = self._held.pop(owner, None)
        if held is None:
            return
        try:
            params = {"key": held.key, "reader": held.reader, "guard": held.guard}
            held.conn.value(UNLOCKS[held.unlock], params)
        except BaseException as exc:  # interrupted too: the connection is no one's
            self._discard(held.conn)
            if not isinstance(exc, psycopg.Error):
                raise
        else:
            self.pool.put(held.conn)

    def _force_release_session(self, name: str, token: int | None, params: dict[str, Any]) -> bool:
        """End the session holding ``name`` (if it is the holder of ``token``), under
        the name's guard."""

        def evict(conn: Connection) -> bool:
            row = conn.execute(sql.REGISTERED_FOR_UPDATE, params).fetchone()
            holder = conn.execute(sql.HOLDER, params).fetchone()
            if holder is None:
                return False  # free: nothing is written
            if token is not None and (row is None or (int(row[0]), row[1]) != (token, holder[0])):
                return False  # another holder than the one shown: left alone
            conn.execute(sql.BUMP, params)
            ended = conn.execute(sql.TERMINATE, {"pids": [holder[0]]}).fetchone()
            return bool(ended and ended[0])

        return self._guarded("force-release", name, evict)
