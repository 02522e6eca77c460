"""Semaphores and read-write locks on Redis: the :class:`RedisPermits` mixin of
:class:`~distlocks.backends.redis.RedisBackend`.

Keys of the name ``name`` (``{prefix}:{<name>}`` is the lock's own key base, so
every key of one name shares the lock's Redis Cluster hash slot)::

    {prefix}:{<name>}:sem           zset: owner -> end of its permit (server ms)
    {prefix}:{<name>}:sem:info      hash: owner -> holder (JSON), for inspection
    {prefix}:{<name>}:sem:waiters   zset: owner -> end of its wait registration
    {prefix}:{<name>}:sem:signal    list: wake-ups for waiters

    {prefix}:{<name>}:rw            zset: owner -> end of its lease (readers and writer)
    {prefix}:{<name>}:rw:info       hash: owner -> holder (JSON, with kind and token)
    {prefix}:{<name>}:rw:writer     string: the owner of the write lease, if any
    {prefix}:{<name>}:rw:wwait      zset: waiting writers -> end of registration
    {prefix}:{<name>}:rw:rwait      zset: waiting readers -> end of registration
    {prefix}:{<name>}:rw:wsig       list: wake-ups for writers
    {prefix}:{<name>}:rw:rsig       list: wake-ups for readers
    {prefix}:{<name>}:rw:fence      the write fencing counter (expires once no lease on
                                    the name is live and the clock has passed it)

Each operation is one Lua script. Holders are scored by the end of their lease on
the server's clock, so every script first drops the permits that ran out: a
crashed holder's permit comes back when its lease ends, without anyone's help.
The keys expire with the last permit; the write counter of a read-write lock once
no token it could hand out next can repeat one issued (see ``keep_fence`` below and
the plain lock's counter in :mod:`distlocks.backends.redis`). A release pushes a
wake-up for the waiters that may now go in (BLPOP), as a lock's release does.

With the backend's listing index, a grant also adds the info hash to the set
``{prefix}:listing:permits``, which a listing reads instead of walking every key; a
listing drops the members whose keys are gone (see :meth:`RedisPermits.indexed_permits`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import threading
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
from distlocks.exceptions import LockBackendUnavailable
from distlocks.logs import log_expected

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

if TYPE_CHECKING:
    from distlocks.backends.redis import Keys


logger = logging.getLogger(__name__)

#: How long a fencing counter is kept past its last change at the least (ms), by the
#: plain lock's scripts (distlocks.backends.redis) and the read-write lock's below.
FENCE_GRACE_MS = 5000

_COMMON = """
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)

-- Drop the permits whose lease ended (a score at or before now).
local function purge(holders, info)
  local dead = redis.call('ZRANGEBYSCORE', holders, '-inf', now_ms)
  for _, owner in ipairs(dead) do redis.call('HDEL', info, owner) end
  if #dead > 0 then redis.call('ZREMRANGEBYSCORE', holders, '-inf', now_ms) end
end

-- The keys of a name live exactly as long as its last permit.
local function tidy(holders, info, writer)
  local last = redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', holders, info)
    if writer then redis.call('DEL', writer) end
    return
  end
  local at = math.floor(tonumber(last[2]))
  redis.call('PEXPIREAT', holders, at)
  redis.call('PEXPIREAT', info, at)
  if writer and redis.call('EXISTS', writer) == 1 then redis.call('PEXPIREAT', writer, at) end
end

-- A waiter stays registered until its registration ends (renewed at each attempt).
local function register(waiters, owner, register_ms)
  redis.call('ZADD', waiters, now_ms + register_ms, owner)
  if redis.call('PTTL', waiters) < register_ms then redis.call('PEXPIRE', waiters, register_ms) end
end

-- One more wake-up, keeping no more of them than there are waiters.
local function signal(list, waiters)
  if waiters <= 0 then return end
  redis.call('RPUSH', list, 1)
  redis.call('LTRIM', list, -waiters, -1)
  redis.call('PEXPIRE', list, 10000)
end

local function holder_json(raw, kind, token, ttl)
  local h = cjson.decode(raw)
  h.kind = kind
  -- Strings: cjson would round numbers of more than 14 digits.
  h.token = string.format('%d', token)
  h.acquired_at = string.format('%d', now_ms)
  h.ttl = ttl
  h.renewals = 0
  return cjson.encode(h)
end

local function renewed(info, owner, ttl)
  local raw = redis.call('HGET', info, owner)
  if raw then
    local h = cjson.decode(raw)
    h.ttl = ttl
    h.renewals = (tonumber(h.renewals) or 0) + 1
    redis.call('HSET', info, owner, cjson.encode(h))
  end
end

local function listing(holders, info, waiting)
  local out = {now_ms, waiting}
  local members = redis.call('ZRANGE', holders, 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 do
    table.insert(out, members[i])
    table.insert(out, members[i + 1])
    table.insert(out, redis.call('HGET', info, members[i]) or '')
  end
  return out
end
"""

# -- semaphores. KEYS: holders, info, waiters, signal. ------------------------------

# ARGV: owner, ttl ms, limit, holder JSON, registration ms (0: not waiting).
# Returns {1, 0, ttl ms} when granted; {0, 0, ms until the first permit ends} when not.
SEM_ACQUIRE = (
    _COMMON
    + """
purge(KEYS[1], KEYS[2])
local owner, ttl = ARGV[1], tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[1], owner) then
  -- A retried request whose first reply was lost: it is ours.
  redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
  tidy(KEYS[1], KEYS[2])
  if KEYS[5] then redis.call('SADD', KEYS[5], KEYS[2]) end
  return {1, 0, ttl}
end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
  redis.call('HSET', KEYS[2], owner, holder_json(ARGV[4], 'semaphore', 0, ttl))
  redis.call('ZREM', KEYS[3], owner)
  tidy(KEYS[1], KEYS[2])
  if KEYS[5] then redis.call('SADD', KEYS[5], KEYS[2]) end
  return {1, 0, ttl}
end
if tonumber(ARGV[5]) > 0 then register(KEYS[3], owner, tonumber(ARGV[5])) end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, 0, math.floor(tonumber(first[2]) - now_ms)}
"""
)

# ARGV: owner. Gives back the caller's own live permit only; wakes one waiter.
SEM_RELEASE = (
    _COMMON
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
purge(KEYS[1], KEYS[2])
if not score or tonumber(score) <= now_ms then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
tidy(KEYS[1], KEYS[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
signal(KEYS[4], redis.call('ZCARD', KEYS[3]))
return 1
"""
)

# ARGV: owner, ttl ms.
SEM_EXTEND = (
    _COMMON
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now_ms then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
renewed(KEYS[2], ARGV[1], tonumber(ARGV[2]))
tidy(KEYS[1], KEYS[2])
return 1
"""
)

# ARGV: owner. A waiter gives up, passing on a wake-up it may have taken.
SEM_LEAVE = (
    _COMMON
    + """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
signal(KEYS[4], redis.call('ZCARD', KEYS[3]))
return 1
"""
)

# ARGV: owner, or '' for every permit. Returns how many live permits were evicted.
SEM_FORCE = (
    _COMMON
    + """
purge(KEYS[1], KEYS[2])
local evicted
if ARGV[1] == '' then
  evicted = redis.call('ZCARD', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
else
  evicted = redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  tidy(KEYS[1], KEYS[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
for _ = 1, evicted do signal(KEYS[4], redis.call('ZCARD', KEYS[3])) end
return evicted
"""
)

# Returns {now ms, waiters, owner, end ms, holder JSON, owner, ...}.
SEM_LIST = (
    _COMMON
    + """
purge(KEYS[1], KEYS[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
return listing(KEYS[1], KEYS[2], redis.call('ZCARD', KEYS[3]))
"""
)

# -- read-write locks. KEYS: holders, info, writer, waiting writers, waiting readers,
# writer signal, reader signal, fence. ------------------------------------------------

_RW = (
    _COMMON
    + """
-- The write counter (KEYS[8]) is kept until the last lease on the name ends and the
-- server clock has passed its value; then a counter started afresh from the clock is
-- above every token issued before (2 ms spare for the rounding), and for the grace
-- the plain lock's counter gets too. Called after every change of the leases' ends
-- and of the counter.
local function keep_fence()
  local value = redis.call('GET', KEYS[8])
  if not value then return end
  local at = math.max(math.floor(tonumber(value) / 1000) + 2, now_ms + FENCE_GRACE_MS)
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if #last > 0 then at = math.max(at, math.ceil(tonumber(last[2]))) end
  redis.call('PEXPIRE', KEYS[8], math.max(1, at - now_ms))
end

-- The next write token: as for a lock, one more than the last and never below the
-- server clock in microseconds, so a lost (or expired) counter cannot make tokens
-- go back.
local function next_token(fence)
  local token = math.max(tonumber(redis.call('GET', fence) or '0') + 1,
                         now[1] * 1000000 + now[2])
  redis.call('SET', fence, string.format('%d', token))
  keep_fence()
  return token
end

-- Drops ended leases and registrations; returns the live writer's owner (or false).
local function purge_rw()
  purge(KEYS[1], KEYS[2])
  local writer = redis.call('GET', KEYS[3])
  if writer and not redis.call('ZSCORE', KEYS[1], writer) then
    redis.call('DEL', KEYS[3])
    writer = false
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms)
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now_ms)
  return writer
end

-- After a lease ended: a waiting writer goes first; readers only when none waits.
local function wake_rw()
  if redis.call('EXISTS', KEYS[3]) == 1 then return end
  local writers = redis.call('ZCARD', KEYS[4])
  if writers > 0 then
    if redis.call('ZCARD', KEYS[1]) == 0 then signal(KEYS[6], writers) end
    return
  end
  local readers = redis.call('ZCARD', KEYS[5])
  for _ = 1, math.min(readers, 1000) do signal(KEYS[7], readers) end
end
""".replace("FENCE_GRACE_MS", str(FENCE_GRACE_MS))
)

# ARGV: kind ('read' or 'write'), owner, ttl ms, holder JSON, registration ms.
# Returns {1, token, ttl ms} when granted (token 0 for a reader); {0, 0, ms until the
# lease in the way ends, or -3 when a waiting writer is in the way} when not.
RW_ACQUIRE = (
    _RW
    + """
local writer = purge_rw()
local kind, owner, ttl, reg = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
if redis.call('ZSCORE', KEYS[1], owner) then
  -- A retried request whose first reply was lost: it is ours.
  redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
  tidy(KEYS[1], KEYS[2], KEYS[3])
  keep_fence()
  if KEYS[9] then redis.call('SADD', KEYS[9], KEYS[2]) end
  local token = 0
  if writer == owner then
    token = tonumber(cjson.decode(redis.call('HGET', KEYS[2], owner)).token)
  end
  return {1, token, ttl}
end
local remaining = -3
local granted = false
if kind == 'read' then
  if writer then
    remaining = math.floor(tonumber(redis.call('ZSCORE', KEYS[1], writer)) - now_ms)
  elseif redis.call('ZCARD', KEYS[4]) == 0 then
    granted = true
  end
else
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #first == 0 then
    granted = true
  else
    remaining = math.floor(tonumber(first[2]) - now_ms)
  end
end
if not granted then
  if reg > 0 then
    if kind == 'read' then register(KEYS[5], owner, reg) else register(KEYS[4], owner, reg) end
  end
  return {0, 0, remaining}
end
local token = 0
if kind == 'write' then
  token = next_token(KEYS[8])
  redis.call('SET', KEYS[3], owner)
  redis.call('ZREM', KEYS[4], owner)
else
  redis.call('ZREM', KEYS[5], owner)
end
redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
redis.call('HSET', KEYS[2], owner, holder_json(ARGV[4], kind, token, ttl))
tidy(KEYS[1], KEYS[2], KEYS[3])
keep_fence()
if KEYS[9] then redis.call('SADD', KEYS[9], KEYS[2]) end
return {1, token, ttl}
"""
)

# ARGV: kind, owner. Gives back the caller's own live lease of that kind only.
RW_RELEASE = (
    _RW
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
local writer = purge_rw()
if not score or tonumber(score) <= now_ms or (ARGV[1] == 'write') ~= (writer == ARGV[2]) then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
if writer == ARGV[2] then redis.call('DEL', KEYS[3]) end
tidy(KEYS[1], KEYS[2], KEYS[3])
keep_fence()  -- down to the leases left: a long released one no longer counts
wake_rw()
return 1
"""
)

# ARGV: kind, owner, ttl ms.
RW_EXTEND = (
    _RW
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
local writer = redis.call('GET', KEYS[3])
if not score or tonumber(score) <= now_ms or (ARGV[1] == 'write') ~= (writer == ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[2])
renewed(KEYS[2], ARGV[2], tonumber(ARGV[3]))
tidy(KEYS[1], KEYS[2], KEYS[3])
keep_fence()
return 1
"""
)

# ARGV: kind, owner. A waiter gives up: readers it held up may go in now.
RW_LEAVE = (
    _RW
    + """
if ARGV[1] == 'write' then redis.call('ZREM', KEYS[4], ARGV[2])
else redis.call('ZREM', KEYS[5], ARGV[2]) end
purge_rw()
wake_rw()
return 1
"""
)

# ARGV: owner, or '' for every lease. The write counter moves on in any case, so an
# evicted writer's token is outdated. Returns how many live leases were evicted.
RW_FORCE = (
    _RW
    + """
local writer = purge_rw()
local evicted
if ARGV[1] == '' then
  evicted = redis.call('ZCARD', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
else
  evicted = redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  if writer == ARGV[1] then redis.call('DEL', KEYS[3]) end
  tidy(KEYS[1], KEYS[2], KEYS[3])
end
next_token(KEYS[8])
wake_rw()
return evicted
"""
)

RW_LIST = (
    _RW
    + """
purge_rw()
return listing(KEYS[1], KEYS[2], redis.call('ZCARD', KEYS[4]) + redis.call('ZCARD', KEYS[5]))
"""
)

# KEYS: the listing index's set of permit info hashes. ARGV: some of its members.
# Drops those whose semaphore or read-write lock has no permit left (keys gone).
PERMITS_TIDY = """
local dropped = 0
for _, info in ipairs(ARGV) do
  local holders = string.sub(info, 1, -6)
  if redis.call('EXISTS', info) == 0 and redis.call('EXISTS', holders) == 0 then
    dropped = dropped + redis.call('SREM', KEYS[1], info)
  end
end
return dropped
"""


class _Script:
    """A Lua script run by its SHA1, sent in full only when the server lacks it, on
    whatever client the backend has (plain, cluster or asyncio)."""

    def __init__(self, lua: str) -> None:
        self.lua = lua
        self.sha = hashlib.sha1(lua.encode()).hexdigest()

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(self.lua, len(keys), *keys, *args)


_SCRIPTS = {
    (SEMAPHORE, "acquire"): _Script(SEM_ACQUIRE),
    (SEMAPHORE, "release"): _Script(SEM_RELEASE),
    (SEMAPHORE, "extend"): _Script(SEM_EXTEND),
    (SEMAPHORE, "leave"): _Script(SEM_LEAVE),
    (SEMAPHORE, "force"): _Script(SEM_FORCE),
    (SEMAPHORE, "list"): _Script(SEM_LIST),
    (RWLOCK, "acquire"): _Script(RW_ACQUIRE),
    (RWLOCK, "release"): _Script(RW_RELEASE),
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


class RedisPermits:
    """Semaphores and read-write locks for :class:`~distlocks.backends.redis.RedisBackend`,
    on the backend's own client, key layout and error mapping.

    The backend's ``iter_locks()`` lists the permits next to the plain locks (through
    :meth:`permits_at`, from the same walk over the keys), so every listing (admin
    page, command, metrics) shows them.
    """

    if TYPE_CHECKING:
        alias: str
        key_prefix: str
        mode: str
        listing_index: bool
        index_permits_key: str

        @property
        def client(self) -> Any: ...

        @property
        def wait_chunk(self) -> float: ...

        def all_keys(self, name: str) -> Keys: ...

        def _errors(self, action: str, name: str) -> contextlib.AbstractContextManager[None]: ...

        def _scan_batches(
            self, pattern: str, *, kind: str | None = None
        ) -> Iterator[list[str]]: ...

        def _hash_pattern(self) -> str: ...

        def check_permit_kind(self, kind: str) -> None: ...

        def release_quietly(self, name: str, owner: str) -> bool: ...

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
        if kind == SEMAPHORE:
            about["limit"] = limit
            op_args: list[Any] = [owner, ttl_ms, limit, json.dumps(about), self._register_ms(wait)]
        else:
            op_args = [kind, owner, ttl_ms, json.dumps(about), self._register_ms(wait)]
        try:
            with self._errors("acquire", name):
                granted, token, remaining_ms = self._permit_run(kind, "acquire", keys, op_args)
        except LockBackendUnavailable as exc:
            if isinstance(exc.__cause__, redis.TimeoutError):
                # The script may have run and only the reply was lost: give the permit
                # back rather than leave it to a lease nobody knows about.
                threading.Thread(
                    target=self._permit_release_quietly, args=(kind, name, owner), daemon=True
                ).start()
            raise
        remaining = None if remaining_ms < 0 else remaining_ms / 1000
        return AcquireResult(bool(granted), int(token), remaining)

    def _permit_release_quietly(self, kind: str, name: str, owner: str) -> None:
        try:
            self.permit_release(kind, name, owner)
        except Exception as exc:
            log_expected(logger, exc, "Could not give back a %s permit of %r", kind, name)

    def _owner_args(self, kind: str, owner: str, *more: Any) -> list[Any]:
        return [owner, *more] if kind == SEMAPHORE else [kind, owner, *more]

    def permit_release(self, kind: str, name: str, owner: str) -> bool:
        self.check_permit_kind(kind)
        keys = self._permit_keys(kind, name)
        with self._errors("release", name):
            return bool(self._permit_run(kind, "release", keys, self._owner_args(kind, owner)))

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
