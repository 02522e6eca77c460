"""Semaphores and read-write locks on Redis: :class:`RedisPermits`, a layer of
:class:`~distlocks.backends.redis.RedisBackend`.

Keys of the name ``name`` (``{prefix}:{<name>}`` is the lock's own key base, so
every key of one name shares the lock's Redis Cluster hash slot)::

    {prefix}:{<name>}:sem           zset: owner -> end of its permit (server ms)
    {prefix}:{<name>}:sem:info      hash: owner -> holder (JSON), for inspection
    {prefix}:{<name>}:sem:waiters   zset: owner -> end of its wait registration
    {prefix}:{<name>}:sem:signal    list: wake-ups for waiters
    {prefix}:{<name>}:sem:released:<owner>  string: the id of the release request that
                                    gave back the owner's permit (5 s; see SEM_RELEASE)

    {prefix}:{<name>}:rw            zset: owner -> end of its lease (readers and writer)
    {prefix}:{<name>}:rw:info       hash: owner -> holder (JSON, with kind and token)
    {prefix}:{<name>}:rw:writer     string: the owner of the write lease, if any
    {prefix}:{<name>}:rw:wwait      zset: waiting writers -> end of registration
    {prefix}:{<name>}:rw:rwait      zset: waiting readers -> end of registration
    {prefix}:{<name>}:rw:wsig       list: wake-ups for writers
    {prefix}:{<name>}:rw:rsig       list: wake-ups for readers
    {prefix}:{<name>}:rw:released:<owner>   string: as ``sem:released:<owner>``
    {prefix}:{<name>}:rw:fence      the write fencing counter (expires once no lease on
                                    the name is live and the clock has passed it)

Each operation is one Lua script. Holders are scored by the end of their lease on
the server's clock, so every script first drops the permits that ran out: a
crashed holder's permit comes back when its lease ends, without anyone's help.
The keys expire with the last permit; the write counter of a read-write lock once
no token it could hand out next can repeat one issued (see ``keep_fence`` below and
the plain lock's counter in :mod:`distlocks.backends.redis.scripts`). A release pushes a
wake-up for the waiters that may now go in (BLPOP), as a lock's release does.

With the backend's listing index, a grant also adds the info hash to the set
``{prefix}:listing:permits``, which a listing reads instead of walking every key; a
listing drops the members whose keys are gone (see :meth:`RedisPermits.indexed_permits`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import redis
from distlocks.backends.base import (
    READ,
    RWLOCK,
    SEMAPHORE,
    WRITE,
    AcquireResult,
    Holder,
    LockInfo,
    holder_details,
    moment,
    permit_family,
)
from distlocks.backends.redis.calls import Undo
from distlocks.backends.redis.lock import RedisLocks, release_id, request_id
from distlocks.backends.redis.permit_scripts import (
    PERMITS_TIDY,
    RW_ACQUIRE,
    RW_EXTEND,
    RW_FORCE,
    RW_GIVE_BACK,
    RW_LEAVE,
    RW_LIST,
    RW_RELEASE,
    SEM_ACQUIRE,
    SEM_EXTEND,
    SEM_FORCE,
    SEM_GIVE_BACK,
    SEM_LEAVE,
    SEM_LIST,
    SEM_RELEASE,
)
from distlocks.exceptions import LockBackendUnavailable

logger = logging.getLogger("distlocks.backends.redis")

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class _Script:
    """A Lua script run by its SHA1, sent in full only when the server lacks it, on
    whatever client the backend has (plain, cluster or asyncio)."""

    def __init__(self, lua: str) -> None:
        self.lua = self.script = lua  # script: as redis-py's scripts name it
        self.sha = hashlib.sha1(lua.encode()).hexdigest()

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(self.lua, len(keys), *keys, *args)


_SCRIPTS = {
    (SEMAPHORE, "acquire"): _Script(SEM_ACQUIRE),
    (SEMAPHORE, "release"): _Script(SEM_RELEASE),
    (SEMAPHORE, "give_back"): _Script(SEM_GIVE_BACK),
    (SEMAPHORE, "extend"): _Script(SEM_EXTEND),
    (SEMAPHORE, "leave"): _Script(SEM_LEAVE),
    (SEMAPHORE, "force"): _Script(SEM_FORCE),
    (SEMAPHORE, "list"): _Script(SEM_LIST),
    (RWLOCK, "acquire"): _Script(RW_ACQUIRE),
    (RWLOCK, "release"): _Script(RW_RELEASE),
    (RWLOCK, "give_back"): _Script(RW_GIVE_BACK),
    (RWLOCK, "extend"): _Script(RW_EXTEND),
    (RWLOCK, "leave"): _Script(RW_LEAVE),
    (RWLOCK, "force"): _Script(RW_FORCE),
    (RWLOCK, "list"): _Script(RW_LIST),
}
_PERMITS_TIDY = _Script(PERMITS_TIDY)
_INFO_SUFFIXES = {":sem:info": SEMAPHORE, ":rw:info": RWLOCK}
_SUFFIXES = {
    SEMAPHORE: ("sem", "sem:info", "sem:waiters", "sem:signal"),
    RWLOCK: ("rw", "rw:info", "rw:writer", "rw:wwait", "rw:rwait", "rw:wsig", "rw:rsig",
             "rw:fence"),
}  # fmt: skip


def _keys_at(family: str, base: str) -> list[str]:
    return [f"{base}:{suffix}" for suffix in _SUFFIXES[family]]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisPermits(RedisLocks):
    """Semaphores and read-write locks for :class:`~distlocks.backends.redis.RedisBackend`,
    on the backend's own client, key layout and error mapping.

    The backend's ``iter_locks()`` lists the permits next to the plain locks (through
    :meth:`permits_at`, from the same walk over the keys), so every listing (admin
    page, command, metrics) shows them.
    """

    if TYPE_CHECKING:
        # RedisListing's walk over the keys, which lists these permits too.
        def _scan_batches(
            self, pattern: str, *, kind: str | None = None
        ) -> Iterator[list[str]]: ...

        def _hash_pattern(self) -> str: ...

    permit_kinds = frozenset({SEMAPHORE, READ, WRITE})

    # -- helpers ----------------------------------------------------------------

    def _permit_keys(self, kind: str, name: str) -> list[str]:
        base = self.all_keys(name).lock.removesuffix(":lock")
        return _keys_at(permit_family(kind), base)

    def _permit_run(self, kind: str, op: str, keys: list[str], args: list[Any]) -> Any:
        return _SCRIPTS[permit_family(kind), op](self.client, keys, args)

    def _register_ms(self, wait: float) -> int:
        # As for locks: the registration outlives one blocking wait by a margin.
        return round((min(wait, self.wait_chunk) + 1.0) * 1000) if wait > 0 else 0

    # -- the permit contract ------------------------------------------------------

    def permit_acquire(
        self,
        kind: str,
        name: str,
        owner: str,
        ttl: float,
        holder: Holder,
        *,
        limit: int = 1,
        wait: float = 0.0,
    ) -> AcquireResult:
        self.check_permit_kind(kind)
        script, keys, args, undo = self._permit_acquire_call(
            kind, name, owner, ttl, holder, limit, wait
        )
        # On a connection in hand: a reply that does not come has the permit's give-back
        # sent behind the request, on the same connection (see _run_taking).
        try:
            with self._errors("acquire", name):
                granted, token, remaining_ms = self._run_taking(script, keys, args, undo)
        except LockBackendUnavailable as exc:
            if isinstance(exc.__cause__, redis.TimeoutError):
                # The script may have run and only the reply was lost: give the permit
                # back rather than leave it to a lease nobody knows about.
                self._give_back_elsewhere(undo, "after a reply that did not come")
            raise
        remaining = None if remaining_ms < 0 else remaining_ms / 1000
        return AcquireResult(bool(granted), int(token), remaining)

    def _permit_acquire_call(
        self, kind: str, name: str, owner: str, ttl: float, holder: Holder, limit: int, wait: float
    ) -> tuple[_Script, list[str], list[Any], Undo]:
        """The acquire script of a permit, its keys and arguments, and its give-back."""
        about = {
            "name": name,
            "host": holder.host,
            "pid": holder.pid,
            "thread": holder.thread,
            "extra": dict(holder.extra),
        }
        ttl_ms = max(1, round(ttl * 1000))
        keys = self._permit_keys(kind, name)
        if self.listing_index:
            keys.append(self.index_permits_key)
        # The request's id, last: what its give-back names (see SEM_GIVE_BACK).
        rid = request_id()
        if kind == SEMAPHORE:
            about["limit"] = limit
            args: list[Any] = [
                owner,
                ttl_ms,
                limit,
                json.dumps(about),
                self._register_ms(wait),
                rid,
            ]
        else:
            args = [kind, owner, ttl_ms, json.dumps(about), self._register_ms(wait), rid]
        undo = (self._permit_undo, kind, name, owner, rid)
        return _SCRIPTS[permit_family(kind), "acquire"], keys, args, undo

    def _owner_args(self, kind: str, owner: str, *more: Any) -> list[Any]:
        return [owner, *more] if kind == SEMAPHORE else [kind, owner, *more]

    def _permit_release_call(self, kind: str, name: str, owner: str) -> tuple[list[str], list[Any]]:
        keys = self._permit_keys(kind, name)
        # An id of its own, as a lock's release: the same request retried after its
        # reply was lost is told it released (see SEM_RELEASE), by its tombstone key.
        keys.append(f"{keys[0]}:released:{owner}")
        if self.listing_index:
            keys.append(self.index_permits_key)  # the name leaves it with its last permit
        return keys, self._owner_args(kind, owner, release_id())

    def _permit_undo(
        self, kind: str, name: str, owner: str, rid: str
    ) -> tuple[str, list[str], list[Any]]:
        """The give-back of the permit acquire request ``rid``, left unanswered: what
        that request was granted, and only that (see SEM_GIVE_BACK)."""
        keys, args = self._permit_release_call(kind, name, owner)
        args[-1] = rid  # in the release's id's place: the give-back leaves no tombstone
        return _SCRIPTS[permit_family(kind), "give_back"].lua, keys, args

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        self.check_permit_kind(kind)
        keys, args = self._permit_release_call(kind, name, owner)
        with self._errors("release", name):
            return bool(self._permit_run(kind, "release", keys, args))

    def permit_extend(self, kind: str, name: str, owner: str, ttl: float) -> bool:
        self.check_permit_kind(kind)
        keys = self._permit_keys(kind, name)
        args = self._owner_args(kind, owner, max(1, round(ttl * 1000)))
        with self._errors("extend", name):
            return bool(self._permit_run(kind, "extend", keys, args))

    def permit_wait(
        self, kind: str, name: str, timeout: float, *, owner: str = "", limit: int = 1
    ) -> None:
        seconds = min(timeout, self.wait_chunk)
        if seconds <= 0.001:
            return
        keys = self._permit_keys(kind, name)
        # The semaphore's signal list, or the writers' or the readers' one.
        signal = keys[3] if kind == SEMAPHORE else keys[5 if kind == WRITE else 6]
        with self._errors("wait for", name):
            self.client.blpop([signal], timeout=seconds)

    def permit_leave(self, kind: str, name: str, owner: str) -> None:
        keys = self._permit_keys(kind, name)
        with self._errors("leave the queue of", name):
            self._permit_run(kind, "leave", keys, self._owner_args(kind, owner))

    def permit_force_release(self, kind: str, name: str, owner: str | None = None) -> int:
        self.check_permit_kind(kind)
        keys = self._permit_keys(kind, name)
        if self.listing_index:
            keys.append(self.index_permits_key)  # the name leaves it with its last permit
        with self._errors("force-release", name):
            return int(self._permit_run(kind, "force", keys, [owner or ""]))

    def permit_counter(self, name: str) -> int:
        self.check_permit_kind(WRITE)
        with self._errors("read the write counter of", name):
            return int(self.client.get(self._permit_keys(WRITE, name)[7]) or 0)

    # -- inspection ---------------------------------------------------------------

    def _holders_at(self, family: str, keys: list[str], name: str) -> list[LockInfo]:
        with self._errors("inspect", name):
            reply = _SCRIPTS[family, "list"](self.client, keys, [])
        return self._holders(family, reply)

    def _holders(self, family: str, reply: list[Any]) -> list[LockInfo]:
        """The permits a listing script's ``reply`` describes."""
        now_ms, waiters = int(reply[0]), int(reply[1])
        now = dt.datetime.now(dt.UTC)
        infos = []
        for i in range(2, len(reply), 3):
            owner, ends_ms, raw = _text(reply[i]), float(reply[i + 1]), _text(reply[i + 2])
            about = holder_details(raw)
            infos.append(self._permit_info(family, owner, ends_ms - now_ms, about, now, waiters))
        return infos

    def _permit_info(
        self,
        family: str,
        owner: str,
        left_ms: float,
        about: dict[str, Any],
        now: dt.datetime,
        waiters: int,
    ) -> LockInfo:
        kind = str(about.get("kind") or (SEMAPHORE if family == SEMAPHORE else READ))
        extra: dict[str, Any] = {**holder_details(about.get("extra")), "kind": kind}
        if kind == SEMAPHORE:
            extra["limit"] = about.get("limit")
        acquired_ms = int(about.get("acquired_at") or 0)
        pid = about.get("pid")
        return LockInfo(
            name=str(about.get("name", "")),
            backend=self.alias,
            owner=owner,
            fencing_token=int(about.get("token") or 0),
            host=str(about.get("host", "")),
            pid=pid if isinstance(pid, int) else None,
            thread=str(about.get("thread", "")),
            acquired_at=moment(_EPOCH, acquired_ms) if acquired_ms else None,
            expires_at=moment(now, left_ms),
            ttl=(float(about["ttl"]) / 1000) if about.get("ttl") else None,
            renewals=int(about.get("renewals") or 0),
            waiters=waiters,
            extra=extra,
        )

    def permit_holders(self, kind: str, name: str) -> list[LockInfo]:
        self.check_permit_kind(kind)
        family = permit_family(kind)
        return self._holders_at(family, self._permit_keys(kind, name), name)

    def iter_permits(self) -> Iterator[LockInfo]:
        found: dict[str, list[str]] = {SEMAPHORE: [], RWLOCK: []}
        for batch in self._scan_batches(self._hash_pattern(), kind="hash"):
            for key in batch:
                if key.endswith(":sem:info"):
                    found[SEMAPHORE].append(key.removesuffix(":sem:info"))
                elif key.endswith(":rw:info"):
                    found[RWLOCK].append(key.removesuffix(":rw:info"))
        yield from self.permits_at(found)

    def indexed_permits(self) -> Iterator[LockInfo]:
        """The live permits of the semaphores and read-write locks in the listing
        index's set; the members found without any are dropped from it (a script checks
        that their keys are gone: a grant meanwhile keeps them)."""
        with self._errors("list", self.key_prefix):
            members = self.client.smembers(self.index_permits_key)
        bases: dict[str, list[str]] = {SEMAPHORE: [], RWLOCK: []}
        for member in map(_text, members):
            for suffix, family in _INFO_SUFFIXES.items():
                if member.endswith(suffix):
                    bases[family].append(member.removesuffix(suffix))
        empty: list[str] = []
        yield from self.permits_at(bases, empty)
        for start in range(0, len(empty), self.PERMIT_BATCH):
            with self._errors("list", self.key_prefix):
                _PERMITS_TIDY(
                    self.client, [self.index_permits_key], empty[start : start + self.PERMIT_BATCH]
                )

    #: Semaphores or read-write locks read by one pipeline of listing scripts.
    PERMIT_BATCH = 500

    def permits_at(
        self, bases: Mapping[str, list[str]], empty: list[str] | None = None
    ) -> Iterator[LockInfo]:
        """The live permits of the semaphores (``bases[SEMAPHORE]``) and read-write
        locks (``bases[RWLOCK]``) whose keys start with the given bases; each is read
        by its own script (which drops its ended permits first), pipelined. The info
        hashes of those without a permit are added to ``empty``, if given."""
        for family, found in bases.items():
            script = _SCRIPTS[family, "list"]
            for start in range(0, len(found), self.PERMIT_BATCH):
                batch = [
                    _keys_at(family, base) for base in found[start : start + self.PERMIT_BATCH]
                ]
                with self._errors("list", self.key_prefix):
                    if self.mode == "cluster":
                        # A cluster client pipelines no scripts: one call each.
                        replies = [script(self.client, keys, []) for keys in batch]
                    else:
                        pipe = self.client.pipeline(transaction=False)
                        for keys in batch:
                            pipe.evalsha(script.sha, len(keys), *keys)
                        replies = pipe.execute(raise_on_error=False)
                    for index, reply in enumerate(replies):
                        if isinstance(reply, redis.exceptions.NoScriptError):
                            # Not loaded on that server yet: run it once in full.
                            replies[index] = script(self.client, batch[index], [])
                        elif isinstance(reply, Exception):
                            raise reply
                for keys, reply in zip(batch, replies, strict=True):
                    if empty is not None and len(reply) <= 2:
                        empty.append(keys[1])
                    yield from self._holders(family, reply)
