"""Redis backend: one lock = one hash with an expiry, taken by one Lua script.

One server (``redis://``, ``rediss://``, ``unix://`` or a django-redis cache), a
Redis Cluster (``redis+cluster://host:port,host:port``) or a primary found through
Sentinel (``redis+sentinel://host:port,host:port/<service>/<db>``): the scripts and
the key layout are the same for all three.

Keys of the lock ``name`` (``prefix`` is ``OPTIONS["key_prefix"]``, default
``DISTLOCKS_KEY_PREFIX``)::

    {prefix}:{<name>}:lock    hash: owner, token, name, host, pid, thread,
                              acquired_at (server ms), ttl (ms), renewals, extra
    {prefix}:{<name>}:fence   the per-name fencing counter (expires once no lease on
                              the name is live and the clock has passed it)

The braces are a Redis Cluster hash tag: every key of a lock (see ``Keys``) lives
in one slot, so every script below touches a single slot. A name that itself
contains a brace, or starts with ``#``, is tagged with ``#`` and a hash of the name
instead (so no plain name can be read as such a tag). The scripts get every
key in KEYS except the fair waiters' own wake-up lists, ``<base>:wake:<owner>``:
the one to push to is the head of the queue, known only inside the script. They
are built from the wake prefix (an argument), which carries the same tag, so they
are in the same slot as the declared keys; a cluster node runs a script that
touches undeclared keys of the slot it serves (the cluster tests check every key
each operation touches).

Every operation that must be atomic (acquire, release, extend, force release)
is one ``EVALSHA``: one round trip, one server-side step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import hashlib
import inspect as pyinspect
import json
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import (
    RWLOCK,
    SEMAPHORE,
    AcquireResult,
    BaseBackend,
    Holder,
    LockInfo,
    holder_details,
    moment,
)
from distlocks.backends.redis_primitives import FENCE_GRACE_MS, RedisPermits
from distlocks.conf import conf
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.redaction import redact, redact_url

try:
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.asyncio.sentinel
    import redis.cluster
    import redis.sentinel
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.connection import parse_url
    from redis.exceptions import NoScriptError, RedisClusterException, SlotNotCoveredError
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImproperlyConfigured(
        "distlocks.backends.redis.RedisBackend needs redis-py: pip install 'distlocks[redis]'."
    ) from exc

# Shared Lua fragments. Waiters register in KEYS waiters (zset owner -> expiry ms);
# fair waiters also queue in KEYS queue (zset owner -> arrival time in us).
_NOW = """
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
"""

# The next fencing token: one more than the last, and never below the server
# clock in microseconds. If the counter is lost (a restart without persistence,
# a failover to a replica that missed the last writes), tokens go on from the
# clock, which is past every token issued before: those were at most one per
# microsecond ahead of it. Lua numbers are doubles, exact up to 2^53 (year 2255).
#
# The same floor lets a counter expire, so that per-call names leave no keys behind:
# once the clock has passed the counter, a counter started afresh from the clock is
# above every token issued before. keep_fence() keeps it until the later of the end
# of the lease on the name (``lease_end_ms``, server ms; 0 when none is live) and the
# moment the clock passes its value (later than now when grants came faster than one
# per microsecond, or Redlock raised it to a token minted by a master whose clock is
# ahead). Every script that grants, renews or force-releases calls it. It also keeps
# the counter FENCE_GRACE_MS past its last change: a read right after a release or a
# force release (the force-release report, fencing_counter()) still finds it, and a
# small step back of the server clock right after a short lease is covered.
_NEXT_TOKEN = """
local function keep_fence(fence, lease_end_ms, now_ms, value)
  value = value or redis.call('GET', fence)
  if not value then return end
  -- 2 ms spare: the division rounds, and the expiry counts from the command's time.
  local at = math.max(lease_end_ms, math.floor(tonumber(value) / 1000) + 2,
                      now_ms + FENCE_GRACE_MS)
  redis.call('PEXPIRE', fence, math.max(1, at - now_ms))
end
local function next_token(fence, now, lease_end_ms)
  local token = math.max(tonumber(redis.call('GET', fence) or '0') + 1,
                         now[1] * 1000000 + now[2])
  redis.call('SET', fence, string.format('%d', token))
  keep_fence(fence, lease_end_ms, now[1] * 1000 + math.floor(now[2] / 1000), token)
  return token
end
""".replace("FENCE_GRACE_MS", str(FENCE_GRACE_MS))

# Forget waiters whose registration expired (they crashed or gave up silently).
_PRUNE = """
local function prune(waiters, queue, now_ms)
  local dead = redis.call('ZRANGEBYSCORE', waiters, '-inf', now_ms)
  if #dead > 0 then
    for _, w in ipairs(dead) do redis.call('ZREM', queue, w) end
    redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now_ms)
  end
end
"""

# Wake one waiter after the lock became free: the head of the fair queue on its
# own list, otherwise any waiter through the shared signal list.
_WAKE = (
    _PRUNE
    + """
local function wake(waiters, queue, signal, wake_prefix, now_ms)
  if redis.call('EXISTS', waiters) == 0 then return end
  prune(waiters, queue, now_ms)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    redis.call('RPUSH', wake_prefix .. head, 1)
    redis.call('PEXPIRE', wake_prefix .. head, 10000)
  elseif redis.call('EXISTS', waiters) == 1 then
    redis.call('RPUSH', signal, 1)
    redis.call('LTRIM', signal, -1, -1)
    redis.call('PEXPIRE', signal, 10000)
  end
end
"""
)

# The listing index (see RedisBackend.rebuild_listing_index): one hash per key prefix,
# field = lock name, value = what a listing shows of the lock, its fields joined by NUL:
# owner, token, host, pid, thread, acquired_at (server ms), expiry (server ms, '' for
# none), ttl (ms), renewals, extra (JSON, last: the only field that may hold a NUL). A
# lock whose other fields hold a NUL gets '' instead: the listing reads its hash.
_ENTRY = """
local function entry(t)
  for i = 1, 9 do
    if string.find(t[i], '\\0', 1, true) then return '' end
  end
  return table.concat(t, '\\0')
end
-- The index entry of a held lock rewritten from its hash, with the expiry given.
local function reindex(index, lock, name, expires)
  local f = redis.call('HMGET', lock, 'owner', 'token', 'host', 'pid', 'thread',
    'acquired_at', 'ttl', 'renewals', 'extra')
  redis.call('HSET', index, name, entry({f[1] or '', f[2] or '', f[3] or '', f[4] or '',
    f[5] or '', f[6] or '', expires, f[7] or '', f[8] or '', f[9] or ''}))
end
local function ms_now()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
"""

# KEYS: lock hash, fence counter, waiters, queue[, listing index].
# ARGV: owner, ttl ms, name, host, pid, thread, extra (JSON), wait ms, fair (0/1).
# ARGV[3] (the name) is also the index field.
# Returns {1, token, ttl ms} when granted; {0, 0, holder's pttl or -3} when not.
ACQUIRE = (
    _NOW
    + _NEXT_TOKEN
    + _PRUNE
    + _ENTRY
    + """
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == ARGV[1] then
  -- Same owner: a retried request whose first reply was lost. It is ours.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
  if KEYS[5] then
    reindex(KEYS[5], KEYS[1], ARGV[3], string.format('%d', now_ms + tonumber(ARGV[2])))
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token')), tonumber(ARGV[2])}
end
local fair = ARGV[9] == '1'
local wait_ms = tonumber(ARGV[8])
local turn = not holder
if turn and fair then
  prune(KEYS[3], KEYS[4], now_ms)
  local head = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  turn = (not head) or head == ARGV[1]
end
if not turn then
  if wait_ms > 0 then
    redis.call('ZADD', KEYS[3], now_ms + wait_ms, ARGV[1])
    if fair then
      redis.call('ZADD', KEYS[4], 'NX', now[1] * 1000000 + now[2], ARGV[1])
    end
  end
  if holder then return {0, 0, redis.call('PTTL', KEYS[1])} end
  return {0, 0, -3}
end
if wait_ms > 0 or fair then
  -- Also on a last attempt made with no time left, so no stale entry stays queued.
  redis.call('ZREM', KEYS[3], ARGV[1])
  if fair then redis.call('ZREM', KEYS[4], ARGV[1]) end
end
local token = next_token(KEYS[2], now, now_ms + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1],
  'owner', ARGV[1], 'token', token, 'name', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'thread', ARGV[6], 'extra', ARGV[7], 'ttl', ARGV[2], 'renewals', 0,
  'acquired_at', now_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if KEYS[5] then
  -- entry() written out: the texts given are the only fields that may hold a NUL.
  local value = ''
  if not string.find(ARGV[1] .. ARGV[4] .. ARGV[5] .. ARGV[6], '\\0', 1, true) then
    value = ARGV[1] .. '\\0' .. string.format('%d', token) .. '\\0' .. ARGV[4] .. '\\0'
      .. ARGV[5] .. '\\0' .. ARGV[6] .. '\\0' .. string.format('%d', now_ms) .. '\\0'
      .. string.format('%d', now_ms + tonumber(ARGV[2])) .. '\\0' .. ARGV[2] .. '\\0' .. '0\\0'
      .. ARGV[7]
  end
  redis.call('HSET', KEYS[5], ARGV[3], value)
end
return {1, token, tonumber(ARGV[2])}
"""
)

# KEYS: lock hash, waiters, queue, signal, fence counter[, listing index]. ARGV: owner,
# wake key prefix[, name: the index field, with the index].
# Compare-and-delete, then wake one waiter. No lease is live any more: the counter is
# kept only until the clock passes it (and the grace), not until the lease would have
# ended, so a per-call name with a long ttl goes soon after its release.
RELEASE = (
    _WAKE
    + _NOW
    + _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
keep_fence(KEYS[5], 0, now_ms)
if KEYS[6] then redis.call('HDEL', KEYS[6], ARGV[3]) end
if redis.call('EXISTS', KEYS[2]) == 1 then
  wake(KEYS[2], KEYS[3], KEYS[4], ARGV[2], now_ms)
end
return 1
"""
)

# KEYS: lock hash, fence counter[, listing index]. ARGV: owner, ttl ms[, name].
# Compare-and-expire; the counter is kept at least as long as the lease.
EXTEND = (
    _ENTRY
    + _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local now_ms = ms_now()
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
  if KEYS[3] then
    reindex(KEYS[3], KEYS[1], ARGV[3], string.format('%d', now_ms + tonumber(ARGV[2])))
  end
  return 1
end
return 0
"""
)

# KEYS: lock hash, fence counter[, listing index]. ARGV: owner, ttl ms[, name].
# EXTEND for a lease its holder has finished with but keeps on purpose for ttl more
# (lock_at_least_for, Lease.release_after): marks it "kept" in its details (JSON) so the
# live-locks page shows a kept lease, not a holder that stopped renewing. Not a renewal.
KEEP = (
    _ENTRY
    + _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local now_ms = ms_now()
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
  local extra = redis.call('HGET', KEYS[1], 'extra') or ''
  if not string.find(extra, '"kept": true', 1, true) then
    if extra == '' or extra == '{}' then
      extra = '{"kept": true}'
    elseif string.sub(extra, 1, 1) == '{' then
      extra = '{"kept": true, ' .. string.sub(extra, 2)
    end
  end
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2], 'extra', extra)
  if KEYS[3] then
    reindex(KEYS[3], KEYS[1], ARGV[3], string.format('%d', now_ms + tonumber(ARGV[2])))
  end
  return 1
end
return 0
"""
)

# KEYS: lock hashes, then their fence counters in the same order[, listing index].
# ARGV: owner, ttl ms, name, owner, ttl ms, name, ... (one triple per lock hash).
# EXTEND for many leases at once (the renewer's batch): one round trip; each lease is
# still compare-and-expire on its own. Returns 1 or 0 per lease, in order.
EXTEND_MANY = (
    _ENTRY
    + _NEXT_TOKEN
    + """
local out = {}
local n = #ARGV / 3
local index = KEYS[2 * n + 1]
local now_ms = ms_now()
for i = 1, n do
  local owner, ttl = ARGV[3 * i - 2], ARGV[3 * i - 1]
  if redis.call('HGET', KEYS[i], 'owner') == owner then
    redis.call('PEXPIRE', KEYS[i], ttl)
    keep_fence(KEYS[n + i], now_ms + tonumber(ttl), now_ms)
    redis.call('HSET', KEYS[i], 'ttl', ttl)
    redis.call('HINCRBY', KEYS[i], 'renewals', 1)
    if index then
      reindex(index, KEYS[i], ARGV[3 * i], string.format('%d', now_ms + tonumber(ttl)))
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

# KEYS: lock hash, fence counter, waiters, queue, signal[, listing index]. ARGV: wake
# key prefix, the holder's fencing token ('' for whoever holds it)[, name].
# Compare-and-delete by token: a lock that changed hands, or is free, is left as it
# is and nothing is written.
# Otherwise the counter moves on, so that the evicted holder's token is already
# outdated, and a waiter is woken.
FORCE_RELEASE = (
    _NOW
    + _NEXT_TOKEN
    + _WAKE
    + """
local token = redis.call('HGET', KEYS[1], 'token')
if not token then return 0 end
if ARGV[2] ~= '' and tonumber(token) ~= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
if KEYS[6] then redis.call('HDEL', KEYS[6], ARGV[3]) end
next_token(KEYS[2], now, 0)
wake(KEYS[3], KEYS[4], KEYS[5], ARGV[1], now_ms)
return 1
"""
)

# KEYS: lock hash, waiters, queue, signal. ARGV: owner, wake key prefix.
# A waiter gives up: it leaves the queue, and if the lock is free it passes on
# a wake-up it may have consumed, so the waiters behind it are not held up.
LEAVE = (
    _NOW
    + _WAKE
    + """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', ARGV[2] .. ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  wake(KEYS[2], KEYS[3], KEYS[4], ARGV[2], now_ms)
end
return 1
"""
)

# What inspection reads of one lock, in this order: the hash fields of _FIELDS, then
# the lock's pttl and its number of registered waiters.
_FIELDS = ("owner", "name", "token", "host", "pid", "thread", "acquired_at", "ttl",
           "renewals", "extra")  # fmt: skip
_DESCRIBE = f"""
local function describe(lock, waiters, out)
  local f = redis.call('HMGET', lock, '{"', '".join(_FIELDS)}')
  if not f[1] then return end
  for j = 1, #f do out[#out + 1] = f[j] end
  out[#out + 1] = redis.call('PTTL', lock)
  out[#out + 1] = redis.call('ZCARD', waiters)
end
"""
_WIDTH = len(_FIELDS) + 2

# KEYS: lock hash, waiters. Returns the values _DESCRIBE lists (empty when free): one
# consistent snapshot. A script rather than MULTI/EXEC, because the cluster client
# refreshes its slot map after a failover for scripts, not for transactions.
INSPECT = (
    _DESCRIBE
    + """
local out = {}
describe(KEYS[1], KEYS[2], out)
return out
"""
)

# KEYS: lock hash, waiters, lock hash, waiters, ... of many locks (not on a cluster:
# they are in many slots). Returns what INSPECT returns for each live one, one after
# the other: a batch of a listing costs one round trip and no per-key reply parsing.
LIST = (
    _DESCRIBE
    + """
local out = {}
for i = 1, #KEYS, 2 do describe(KEYS[i], KEYS[i + 1], out) end
return out
"""
)

# KEYS: listing index, then lock hash, waiters of each lock. ARGV: the names of the
# locks (the index fields), or none: each lock's name is then read from its hash.
# Each index entry made true: rewritten from the lock's hash if held, dropped if the
# lock is free (with its name given). Returns what LIST returns for the held ones.
# Keeps the index of a listing (an entry whose expiry is past, or that is due now) and
# builds it (a first listing, from a SCAN of the lock hashes).
INDEX = (
    _DESCRIBE
    + _ENTRY
    + """
local now_ms = ms_now()
local out = {}
for i = 2, #KEYS, 2 do
  local at = #out
  describe(KEYS[i], KEYS[i + 1], out)
  local name = ARGV[i / 2] or out[at + 2]
  if #out == at then
    if ARGV[i / 2] then redis.call('HDEL', KEYS[1], name) end
  elseif name then
    local expires = ''
    if out[at + 11] >= 0 then expires = string.format('%d', now_ms + out[at + 11]) end
    reindex(KEYS[1], KEYS[i], name, expires)
  end
end
return out
"""
)

# The listing index's epoch (see RedisBackend.INDEX_EPOCH_FIELD): a field of the index
# hash, and the member '<field>:<epoch>' of its permits set. A rebuild writes
# '~<epoch>' when it starts and '<epoch>' when it is done, if nothing was lost meanwhile.
# KEYS: listing index, permits set. ARGV: epoch field, '~' .. new epoch.
INDEX_BEGIN = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then redis.call('SREM', KEYS[2], ARGV[1] .. ':' .. old) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1] .. ':' .. ARGV[2])
return 1
"""
# KEYS: listing index, permits set, marker. ARGV: epoch field, '~' .. epoch, epoch.
# 1 if the index is whole from now on, 0 if the rebuild's start was lost meanwhile.
INDEX_DONE = """
local member = ARGV[1] .. ':' .. ARGV[2]
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2]
    or redis.call('SISMEMBER', KEYS[2], member) == 0 then
  return 0
end
redis.call('SREM', KEYS[2], member)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1] .. ':' .. ARGV[3])
redis.call('SET', KEYS[3], '1')
return 1
"""
SCRIPTS = {
    "acquire": ACQUIRE,
    "release": RELEASE,
    "extend": EXTEND,
    "keep": KEEP,
    "extend_many": EXTEND_MANY,
    "force_release": FORCE_RELEASE,
    "leave": LEAVE,
    "inspect": INSPECT,
    "list": LIST,
    "index": INDEX,
    "index_begin": INDEX_BEGIN,
    "index_done": INDEX_DONE,
}


_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_LOCATION_FORMS = (
    "start with redis://, rediss:// or unix:// (one server), "
    "redis+cluster:// (a Redis Cluster: redis+cluster://host:port[,host:port...]) or "
    "redis+sentinel:// (Sentinel: redis+sentinel://host:port[,host:port...]/<service>[/<db>])"
)
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


@dataclasses.dataclass(frozen=True)
class Location:
    """A parsed ``LOCATION``: one server, a Redis Cluster, or a Sentinel service."""

    #: "server", "cluster" or "sentinel".
    mode: str
    #: (host, port) of each cluster node or Sentinel named (empty for one server).
    nodes: tuple[tuple[str, int], ...] = ()
    #: The Sentinel service: the name its ``sentinel monitor`` line gives the primary.
    service: str = ""
    db: int = 0
    #: Options for the Redis servers from the URL: credentials, TLS, query string.
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _node(text: str, default_port: int, location: str) -> tuple[str, int]:
    try:
        parts = urlsplit(f"//{text}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or "@" in text or parts.path:
        raise ValueError(f"LOCATION {location!r} has {text!r} where host:port belongs")
    return host, port or default_port


def _parse_error(exc: ValueError, location: str) -> str:
    """The URL parser's complaint, without any piece of the URL's user information
    (a password holding "/" or "@" is cut by the parser into a "port" or a "path" it
    then quotes), and what to change."""
    text = redact(exc)
    userinfo = location.partition("://")[2].rpartition("@")[0]
    for piece in sorted(set(re.split(r"[/?#@:;&=,\s]+", userinfo)), key=len, reverse=True):
        # Quoted, any piece is masked; bare, only one long enough not to be a word.
        for quoted in (f"'{piece}'", f'"{piece}"'):
            text = text.replace(quoted, "'***'")
        if len(piece) >= 4:
            text = text.replace(piece, "***")
    return (
        f"{text} (a password holding '/', '@', ':', '?' or '#' must be percent-encoded, "
        f"e.g. with urllib.parse.quote(password, safe=''))"
    )


def parse_location(location: str) -> Location:
    """Parse a ``LOCATION`` URL (no I/O); ValueError saying what to change if invalid.

    ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]`` names
    some nodes of a Redis Cluster (the client finds the others);
    ``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>][?options]``
    names Sentinels and the service they watch. ``rediss+`` turns TLS on for the Redis
    servers. Credentials and options apply to the Redis servers, as in a ``redis://``
    URL; the Sentinels' own are ``OPTIONS["sentinel_kwargs"]``.
    """
    shown = redact_url(location)  # messages quote the URL without its password
    scheme = location.partition("://")[0].lower() if "://" in location else ""
    if scheme in _SCHEMES:
        try:
            parse_url(location)  # what the client does on first use, read now
        except ValueError as exc:
            raise ValueError(f"LOCATION {shown!r}: {_parse_error(exc, location)}") from None
        path = urlsplit(location).path if scheme != "unix" else ""
        if path.strip("/") and not path.strip("/").isdigit():
            # redis-py would quietly use database 0 instead.
            raise ValueError(
                f"LOCATION {shown!r}: the path must be a database number (e.g. /0), "
                f"not {redact(path)!r}"
            )
        return Location("server")
    if scheme not in _CLUSTER_SCHEMES + _SENTINEL_SCHEMES:
        raise ValueError(f"LOCATION {shown!r} must {_LOCATION_FORMS}")
    cluster = scheme in _CLUSTER_SCHEMES
    example = (
        "redis+cluster://host:port,host:port"
        if cluster
        else "redis+sentinel://host:port,host:port/<service>/0"
    )
    rest = location.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    if not hosts:
        raise ValueError(f"LOCATION {shown!r} names no host; write e.g. {example}")
    default_port = 6379 if cluster else 26379
    nodes = tuple(_node(text, default_port, shown) for text in hosts.split(","))
    segments = [segment for segment in path.split("/") if segment]
    service, db_text = "", "0"
    if cluster:
        if segments not in ([], ["0"]):
            raise ValueError(
                f"LOCATION {shown!r}: a Redis Cluster has database 0 only; "
                f"drop the path, e.g. {example}"
            )
    elif len(segments) not in (1, 2):
        raise ValueError(
            f"LOCATION {shown!r} must name the service the Sentinels watch, "
            f"and optionally a database: {example}"
        )
    else:
        service, db_text = segments[0], (segments[1:] or ["0"])[0]
    if not db_text.isdigit():
        raise ValueError(f"LOCATION {shown!r}: database {db_text!r} is not a number")
    tls = scheme.startswith("rediss")
    credentials = f"{userinfo}@" if userinfo else ""
    try:
        # Credentials and query options are read exactly as for a redis:// URL.
        options = parse_url(f"redis://{credentials}localhost/0?{query}")
    except ValueError as exc:
        raise ValueError(f"LOCATION {shown!r}: {_parse_error(exc, location)}") from None
    for key in ("host", "port", "db", "path", "connection_class"):
        options.pop(key, None)
    if tls:
        options["ssl"] = True
    return Location("cluster" if cluster else "sentinel", nodes, service, int(db_text), options)


class Keys(NamedTuple):
    """The keys of one lock (all share one hash tag, so one cluster slot)."""

    lock: str
    fence: str
    waiters: str
    queue: str
    signal: str
    wake_prefix: str


# What the driver raises; every one becomes a LockError (see RedisBackend._error).
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


_pid = os.getpid

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


class _Pinned:
    """A connection taken from a backend's pool for one thread, for as long as that
    thread lives: given back to the pool when the thread's local storage goes."""

    __slots__ = ("__weakref__", "conn", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.conn = pool.get_connection()

    def __del__(self) -> None:
        if self.pool is not None:
            with contextlib.suppress(Exception):  # at thread exit or interpreter shutdown
                self.pool.release(self.conn)


def _extra_json(extra: Mapping[str, Any]) -> str:
    return json.dumps(dict(extra), separators=(",", ":")) if extra else "{}"


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


logger = logging.getLogger(__name__)

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MILLISECOND = dt.timedelta(milliseconds=1)
#: Milliseconds since the epoch that make a date (years 1 to 9999).
_MIN_MS = (dt.datetime.min.replace(tzinfo=dt.UTC) - _EPOCH) // _MILLISECOND
_MAX_MS = (dt.datetime.max.replace(tzinfo=dt.UTC) - _EPOCH) // _MILLISECOND


def _decoded(values: list[Any]) -> list[Any]:
    """``values`` with bytes decoded (the client may or may not decode replies)."""
    return [value.decode() if type(value) is bytes else value for value in values]


def _decode(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _summaries(values: list[Any], now_ms: int, texts: dict[Any, Any]) -> Iterator[tuple[Any, ...]]:
    """The tuples of :meth:`RedisBackend.iter_lock_summaries` for ``values`` (the LIST
    script's reply, not decoded), read at ``now_ms``: the values
    :meth:`RedisBackend._info` makes of them, without datetimes or parsed JSON. The
    texts most locks share (host, thread, details, ttl) are decoded once, through
    ``texts``."""
    for at in range(0, len(values), _WIDTH):
        owner, name, token, host, pid, thread, acquired, ttl, renewals, extra, pttl, waiters = (
            values[at : at + _WIDTH]
        )
        shared = texts.get((host, thread, extra, ttl))
        if shared is None:
            shared = texts[host, thread, extra, ttl] = (
                _decode(host), _decode(thread), _decode(extra), int(ttl or 0) / 1000 or None
            )  # fmt: skip
        acquired = int(acquired) if acquired else None
        if acquired is not None and not _MIN_MS <= acquired <= _MAX_MS:
            acquired = None  # no date (see moment())
        expires = now_ms + pttl if pttl >= 0 else None
        if expires is not None and not _MIN_MS <= expires <= _MAX_MS:
            expires = None
        yield (
            name.decode() if type(name) is bytes else name or "",
            owner.decode() if type(owner) is bytes else owner,
            int(token or 0), shared[0], int(pid) if pid and pid.isdigit() else None,
            shared[1], acquired, expires, shared[3], int(renewals or 0), int(waiters),
            shared[2],
        )  # fmt: skip


def _positive(options: Mapping[str, Any], key: str, problems: list[str]) -> None:
    value = options.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        problems.append(f"OPTIONS['{key}'] must be a number of seconds > 0, not {value!r}")


class RedisBackend(RedisPermits, BaseBackend):
    """Locks on one Redis server (or a django-redis cache's server), on a Redis
    Cluster, or on the primary that Sentinel names."""

    wakes_on_release = True

    config_keys: ClassVar[frozenset[str]] = frozenset({"OPTIONS", "LOCATION", "CACHE"})
    option_keys: ClassVar[frozenset[str] | None] = frozenset(
        {
            "socket_timeout",
            "socket_connect_timeout",
            "async_pool_size",
            "listing_index",
            "key_prefix",
            "client_kwargs",
            "sentinel_kwargs",
        }
    )

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

    # -- configuration ----------------------------------------------------------

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        problems = super().validate_config(alias, config)
        location, cache = config.get("LOCATION"), config.get("CACHE")
        if (location is None) == (cache is None):
            problems.append(
                "set exactly one of LOCATION (a redis://, rediss://, unix://, "
                "redis+cluster:// or redis+sentinel:// URL) "
                "or CACHE (the alias of a django-redis cache)"
            )
        if location is not None:
            if not isinstance(location, str):
                problems.append(f"LOCATION must be a URL string, not {type(location).__name__}")
            else:
                try:
                    parse_location(location)
                except ValueError as exc:
                    problems.append(str(exc))
        if cache is not None:
            caches = getattr(settings, "CACHES", {})
            if not isinstance(cache, str) or cache not in caches:
                problems.append(f"CACHE {cache!r} is not an alias defined in CACHES")
            elif not str(caches[cache].get("BACKEND", "")).startswith("django_redis."):
                problems.append(
                    f"CACHE {cache!r} must be a django-redis cache "
                    f"(BACKEND 'django_redis.cache.RedisCache'); use LOCATION otherwise"
                )
        options = config.get("OPTIONS") or {}
        if isinstance(options, Mapping):
            _positive(options, "socket_timeout", problems)
            _positive(options, "socket_connect_timeout", problems)
            size = options.get("async_pool_size", cls.DEFAULT_ASYNC_POOL_SIZE)
            if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= 100_000:
                problems.append(
                    f"OPTIONS['async_pool_size'] must be an int from 2 to 100,000 (connections "
                    f"per event loop), not {size!r}"
                )
            index = options.get("listing_index", True)
            if not isinstance(index, bool):
                problems.append(
                    f"OPTIONS['listing_index'] must be True or False (keep an index the "
                    f"live-locks listing reads instead of every lock), not {index!r}"
                )
            # The global DISTLOCKS_KEY_PREFIX has a check of its own (E007).
            prefix = options.get("key_prefix", "default")
            if not isinstance(prefix, str) or not prefix or set("{}") & set(prefix):
                problems.append(
                    f"OPTIONS['key_prefix'] {prefix!r} must be a non-empty str without braces"
                )
            kwargs = options.get("client_kwargs", {})
            if not isinstance(kwargs, Mapping):
                problems.append("OPTIONS['client_kwargs'] must be a dict of redis-py arguments")
            sentinel_kwargs = options.get("sentinel_kwargs")
            if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
                problems.append(
                    "OPTIONS['sentinel_kwargs'] must be a dict of redis-py arguments "
                    "for the connections to the Sentinels (e.g. {'password': ...})"
                )
            elif sentinel_kwargs is not None and not (
                isinstance(location, str) and location.lower().startswith(_SENTINEL_SCHEMES)
            ):
                problems.append(
                    "OPTIONS['sentinel_kwargs'] is only read with a redis+sentinel:// LOCATION"
                )
        return problems

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

    @contextlib.asynccontextmanager
    async def _call_slot(self, side: _AsyncSide) -> AsyncIterator[None]:
        """One of the loop's connections for a quick call: at once when one is free,
        else in turn behind the coroutines already waiting for one."""
        slots = side.calls
        if slots.locked():
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
        else:
            await slots.acquire()
        try:
            yield
        finally:
            slots.release()

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

    # -- keys -----------------------------------------------------------------

    def keys(self, name: str) -> tuple[str, str]:
        """The lock hash key and the fencing counter key of ``name``."""
        keys = self.all_keys(name)
        return keys.lock, keys.fence

    def all_keys(self, name: str) -> Keys:
        """Every key of ``name``, all in one Redis Cluster slot."""
        keys = self._keys_cache.get(name)
        if keys is None:
            if len(self._keys_cache) >= 4096:
                self._keys_cache.clear()
            keys = self._keys_cache[name] = self._make_keys(name)
        return keys

    def _make_keys(self, name: str) -> Keys:
        tag = name
        if "{" in name or "}" in name or name.startswith("#"):
            # Braces would break the hash tag: such a name is tagged with a hash of
            # itself, marked by "#". A plain name starting with "#" is hashed too, so
            # it can never be taken for (and share the keys of) a hashed one.
            tag = "#" + hashlib.sha256(name.encode()).hexdigest()[:32]
        base = f"{self.key_prefix}:{{{tag}}}"
        return Keys(
            lock=f"{base}:lock",
            fence=f"{base}:fence",
            waiters=f"{base}:waiters",
            queue=f"{base}:queue",
            signal=f"{base}:signal",
            wake_prefix=f"{base}:wake:",
        )

    # -- calls ----------------------------------------------------------------

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

    @contextlib.contextmanager
    def _acquiring(self, name: str, owner: str) -> Iterator[None]:
        """:meth:`_errors` for an acquire (see :meth:`_acquire_error`)."""
        try:
            yield
        except _DRIVER_ERRORS as exc:
            raise self._acquire_error(name, owner, exc) from exc

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
            if slot.pool is pool and slot.conn.pid == _pid():
                return slot.conn
            # The backend was closed since (a new pool), or this is a forked child,
            # where the parent's connection must not be used nor given back.
            if slot.conn.pid != _pid():
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
                    return await conn.read_response()
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
        client, scripts = side.client, side.scripts
        if self._direct:
            async with self._call_slot(side):
                return await self._arun_direct(side, script, keys, args)
        async with self._call_slot(side):
            try:
                return await scripts[script](keys=keys, args=args, client=client)
            except redis.ResponseError as exc:
                if not self._demoted(exc):
                    raise
            await client.connection_pool.disconnect(inuse_connections=False)
            return await scripts[script](keys=keys, args=args, client=client)

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

    def _acquire_call(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> tuple[list[str], list[Any]]:
        keys = self.all_keys(name)
        # A waiter's registration outlives one blocking wait by a margin; it is
        # renewed at every attempt, and dropped by the others once it lapses.
        register_ms = round((min(wait, self.wait_chunk) + 1.0) * 1000) if wait > 0 else 0
        args = [
            owner, max(1, round(ttl * 1000)), name, holder.host, holder.pid, holder.thread,
            _extra_json(holder.extra), register_ms, int(fair),
        ]  # fmt: skip
        return [keys.lock, keys.fence, keys.waiters, keys.queue], args

    # The calls of the acquire and release scripts without the listing index (as Redlock
    # runs them on its masters) and with it (this backend's own calls).

    def _indexed_acquire_call(
        self, name: str, owner: str, ttl: float, holder: Holder, wait: float, fair: bool
    ) -> tuple[list[str], list[Any]]:
        keys, args = self._acquire_call(name, owner, ttl, holder, wait, fair)
        return keys + self._index, args

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
        try:
            reply = self._run("acquire", keys, args)
        except _DRIVER_ERRORS as exc:
            raise self._acquire_error(name, owner, exc) from exc
        return self._acquire_result(reply)

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
        with self._acquiring(name, owner):
            return self._acquire_result(await self._arun("acquire", keys, args))

    def _release_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        k = self.all_keys(name)
        return [k.lock, k.waiters, k.queue, k.signal, k.fence], [owner, k.wake_prefix]

    def _indexed_release_call(self, name: str, owner: str) -> tuple[list[str], list[Any]]:
        keys, args = self._release_call(name, owner)
        if self._index:
            return keys + self._index, [*args, name]
        return keys, args

    def release(self, name: str, owner: str) -> bool:
        keys, args = self._indexed_release_call(name, owner)
        try:
            return bool(self._run("release", keys, args))
        except _DRIVER_ERRORS as exc:
            raise self._error("release", name, exc) from exc

    async def arelease(self, name: str, owner: str) -> bool:
        with self._errors("release", name):
            return bool(await self._arun("release", *self._indexed_release_call(name, owner)))

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
            except _DRIVER_ERRORS as exc:
                error = self._error("renew", f"{len(chunk)} leases", exc)
                error.__cause__ = exc
                results += [error] * len(chunk)
                continue
            results += [bool(reply) for reply in replies]
        return results

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
        registered = self._scripts["acquire"]
        pop = ("BLPOP", self._wait_key(name, owner, fair), f"{seconds:.3f}")
        run = ("EVALSHA", registered.sha, len(keys), *keys, *args)
        try:
            if _hiredis_pack is not None and type(conn._command_packer) is _HiredisPacker:
                conn.send_packed_command([_hiredis_pack(pop), _hiredis_pack(run)])
            else:
                conn.send_packed_command(conn.pack_commands([pop, run]))
            conn.read_response()  # the wake-up, or nothing at the end of the wait
            reply = conn.read_response()
        except NoScriptError:
            # Both replies were read; the script is loaded by the plain path.
            return self.acquire(name, owner, ttl, holder, wait=wait, fair=fair)
        except redis.ConnectionError:
            # Broken while idle or while waiting: the caller's next plain acquire
            # reconnects (and is safe to repeat, by owner).
            conn.disconnect()
            return None
        except _DRIVER_ERRORS as exc:
            # A reply may still be unread: this connection cannot be trusted any more.
            conn.disconnect()
            raise self._acquire_error(name, owner, exc) from exc
        except BaseException:
            # Interrupted with the attempt sent: it may have taken the lock for an owner
            # nobody will release. Give it back (off this thread), as after a timeout.
            conn.disconnect()
            threading.Thread(target=self.release_quietly, args=(name, owner), daemon=True).start()
            raise
        return self._acquire_result(reply)

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
            registered = side.scripts["acquire"]
            await _asend(
                conn,
                ("BLPOP", self._wait_key(name, owner, fair), f"{left:.3f}"),
                ("EVALSHA", registered.sha, len(keys), *keys, *args),
            )
            await conn.read_response()  # the wake-up, or nothing at the end of the wait
            reply = await conn.read_response()
        except NoScriptError:
            return await self.aacquire(name, owner, ttl, holder, wait=wait, fair=fair)
        except redis.ConnectionError:
            await conn.disconnect(nowait=True)
            return None  # the caller's plain acquire reconnects (safe to repeat, by owner)
        except _DRIVER_ERRORS as exc:
            await conn.disconnect(nowait=True)
            raise self._acquire_error(name, owner, exc) from exc
        except BaseException:
            # Cancelled with the attempt sent: give back what it may have taken.
            await conn.disconnect(nowait=True)
            threading.Thread(target=self.release_quietly, args=(name, owner), daemon=True).start()
            raise
        finally:
            side.idle.append(conn)
            side.waits.release()
        return self._acquire_result(reply)

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

    # -- inspection -----------------------------------------------------------

    #: Keys one SCAN call walks on the server (it returns those that match). The server
    #: serves nobody else during a call: 1,000 keys (with MATCH and TYPE) take about
    #: 2 ms of it, 10,000 took 50 ms and more, so a listing takes more round trips of a
    #: bounded cost rather than a few long ones.
    SCAN_COUNT = 1_000
    #: Locks read by one listing script (or one pipeline, on a cluster): 250 take about
    #: 4 ms of server time, 1,000 took 30 ms and more.
    LIST_BATCH = 250

    def _info(self, values: Sequence[Any], at: int, now: dt.datetime) -> LockInfo:
        """The lock described by ``values[at:at + _WIDTH]`` (the layout of INSPECT, with
        the strings decoded)."""
        owner, name, token, host, pid, thread, acquired, ttl, renewals, extra, pttl, waiters = (
            values[at : at + _WIDTH]
        )
        details = holder_details(extra)
        return LockInfo(
            name=name or "",
            backend=self.alias,
            owner=owner,
            fencing_token=int(token or 0),
            host=host or "",
            pid=int(pid) if pid and pid.isdigit() else None,
            thread=thread or "",
            acquired_at=moment(_EPOCH, int(acquired)) if acquired else None,
            expires_at=moment(now, pttl) if pttl >= 0 else None,
            ttl=int(ttl or 0) / 1000 or None,
            renewals=int(renewals or 0),
            # Lapsed registrations are pruned at every release, so ZCARD is close enough.
            waiters=int(waiters),
            extra=details,
        )

    def inspect(self, name: str) -> LockInfo | None:
        keys = self.all_keys(name)
        with self._errors("inspect", name):
            values = _decoded(self._run("inspect", [keys.lock, keys.waiters], []))
        return self._info(values, 0, dt.datetime.now(dt.UTC)) if values else None

    def iter_locks(self) -> Iterator[LockInfo]:
        """Every lock, then every semaphore permit and read-write lease, found by one
        walk over this backend's hashes (one per lock, semaphore or read-write lock)."""
        for locks, permits in self._walk():
            for start in range(0, len(locks), self.LIST_BATCH):
                yield from self._describe(locks[start : start + self.LIST_BATCH])
            if permits is not None:
                yield from self.permits_at(permits)

    def iter_lock_summaries(self) -> Iterator[tuple[Any, ...] | LockInfo | str]:
        """What :meth:`iter_locks` lists, in the cheaper form a listing of many locks
        reads (:func:`distlocks.livelocks.collect` uses this method when a backend has
        it): the same walk and the same server reads, but each lock as one tuple of
        plain values, without the datetimes and the parsed holder details of a
        :class:`LockInfo`, which a page of live locks needs for its shown rows only::

            (name, owner, fencing_token, host, pid, thread, acquired_ms, expires_ms,
             ttl, renewals, waiters, extra)

        ``acquired_ms`` and ``expires_ms`` are milliseconds since the epoch (None where
        :meth:`iter_locks` has no date), ``extra`` the holder's details as the JSON text
        stored (:func:`~distlocks.backends.base.holder_details` reads it); the other
        values are those of the :class:`LockInfo` fields of the same names. Repeated
        texts (host, thread, details) are shared between tuples. Permits come after the
        locks as :class:`LockInfo` objects, as :meth:`iter_locks` yields them.

        With the listing index (:attr:`listing_index`, see :meth:`rebuild_listing_index`)
        the locks are read from it, and their ``waiters`` are None (a page's shown rows
        read theirs in full). A listing that finds the index lost says so with a str,
        a note for the operator, among the items (the locks are listed all the same).

        A subclass that overrides :meth:`iter_locks` is listed through it instead."""
        if type(self).iter_locks is not RedisBackend.iter_locks:
            yield from self.iter_locks()
            return
        if self.listing_index:
            yield from self._indexed_summaries()
            return
        texts: dict[Any, Any] = {}  # (host, thread, details, ttl) as stored -> as listed
        for locks, permits in self._walk():
            for start in range(0, len(locks), self.LIST_BATCH):
                values, now = self._list_values(locks[start : start + self.LIST_BATCH], False)
                yield from _summaries(values, (now - _EPOCH) // _MILLISECOND, texts)
            if len(texts) > 10_000:
                texts.clear()  # many different holders: start again
            if permits is not None:
                yield from self.permits_at(permits)

    # -- the listing index -------------------------------------------------------

    #: Entries whose expiry is within this many milliseconds of the server's clock
    #: (either way) when the index was read are checked against their lock's hash.
    INDEX_MARGIN_MS = 1000
    #: Entries whose expiry is past checked (and dropped, or corrected) per listing; any
    #: more are left out of it as expired and checked by the next listings.
    INDEX_SETTLE_LIMIT = 10_000
    #: Index fields one listing call reads (``HSCAN ... COUNT``): the server's time for
    #: one call grows with it (about 1.5 ms per 1,000; 10-35 ms at 10,000), and other
    #: clients wait that long; a listing of 100,000 locks is then 100 round trips.
    INDEX_CHUNK = 1_000
    #: The field of the index hash that holds its epoch (no lock name has a control
    #: character, so no lock has this name); see :meth:`rebuild_listing_index`.
    INDEX_EPOCH_FIELD = "\x00epoch"

    def rebuild_listing_index(self) -> bool:
        """Build the listing index from a walk over the lock hashes (``SCAN``); True if
        it is whole afterwards, False if it was lost again meanwhile (the next listing
        then builds it again).

        The index is one hash per key prefix, ``{prefix}:listing``: a field per held
        lock (its name), whose value holds what a listing shows of it. The acquire,
        extend, release and force release scripts write it in the same step as the
        lock, so a listing reads that one key (``HSCAN``) instead of every lock. An
        entry stays after its lock expired: a listing leaves out the entries whose
        expiry is past, and drops them after checking (in a script) that the lock is
        gone, correcting those whose lock is still held. The semaphores and read-write
        locks with permits are in a set, ``{prefix}:listing:permits`` (their info
        hashes), each read in full by a listing.

        The index carries an epoch (:attr:`INDEX_EPOCH_FIELD`, a field of the hash and
        a member of the permits set), set by this method when it is done, and the
        marker ``{prefix}:listing:built``. A key of the index can be lost on its own (a
        ``DEL``, eviction under an ``allkeys-*`` policy) and made again, partly, by the
        next lock taken: without its epoch. A listing that finds the index without its
        epoch or marker (a new server, an upgrade from a version without the index, a
        lost key), or finds the epoch changed between two of its chunks, lists by a
        walk over every key instead, which calls this on the way, and says so. This
        indexes every lock and permit found, corrects or drops the entries not found,
        then sets the epoch and the marker. Locks taken or released by a process that
        does not write the index (an older version, ``listing_index`` off) are not in
        it, or shown until their expiry: once every process writes it, delete the
        marker to have the next listing build it again."""
        if not self.listing_index:
            raise LockError(f"backend {self.alias!r} keeps no listing index")
        done = True
        for item in self._rebuilding_summaries(set(), {}):
            if type(item) is str:
                done = False
        return done

    def _rebuilding_summaries(
        self, seen: set[str], texts: dict[Any, Any]
    ) -> Iterator[tuple[Any, ...] | LockInfo | str]:
        """:meth:`iter_lock_summaries` from a walk over every key (``SCAN``), which
        rebuilds the index on the way (see :meth:`rebuild_listing_index`): the locks
        whose names are not in ``seen`` (each added), the permits, then a note (a
        str) if the index was lost again meanwhile."""
        epoch = str(uuid.uuid4())
        index = [self.index_key, self.index_permits_key]
        with self._errors("list", self.key_prefix):
            self._run("index_begin", index, [self.INDEX_EPOCH_FIELD, "~" + epoch])
        for locks, permits in self._walk():
            for start in range(0, len(locks), self.LIST_BATCH):
                values = self._index_run(locks[start : start + self.LIST_BATCH], [])
                now_ms = (dt.datetime.now(dt.UTC) - _EPOCH) // _MILLISECOND
                yield from self._unseen(_summaries(values, now_ms, texts), seen)
            if permits:
                members = [f"{base}:sem:info" for base in permits[SEMAPHORE]]
                members += [f"{base}:rw:info" for base in permits[RWLOCK]]
                with self._errors("list", self.key_prefix):
                    for start in range(0, len(members), self.LIST_BATCH):
                        self.client.sadd(
                            self.index_permits_key, *members[start : start + self.LIST_BATCH]
                        )
                yield from self.permits_at(permits)
        # Entries the walk did not find: of locks gone (dropped), or taken since their
        # key's turn in the walk (rewritten, and listed).
        unseen: list[Any] = []
        for names in self._index_names():
            unseen += [name for name in names if _decode(name) not in seen]
            while len(unseen) >= self.LIST_BATCH or (unseen and not names):
                batch, unseen = unseen[: self.LIST_BATCH], unseen[self.LIST_BATCH :]
                values = self._settle(batch)
                now_ms = (dt.datetime.now(dt.UTC) - _EPOCH) // _MILLISECOND
                yield from self._unseen(_summaries(values, now_ms, texts), seen)
        with self._errors("list", self.key_prefix):
            done = self._run(
                "index_done",
                [*index, self.index_marker_key],
                [self.INDEX_EPOCH_FIELD, "~" + epoch, epoch],
            )
        if not done:
            note = (
                f"The listing index of backend {self.alias!r} was lost again while it was "
                f"rebuilt, so the rebuild could not be finished; this listing read every "
                f"key all the same, and the next one rebuilds the index."
            )
            logger.warning("%s", note)
            yield note

    @staticmethod
    def _unseen(summaries: Iterator[tuple[Any, ...]], seen: set[str]) -> Iterator[tuple[Any, ...]]:
        for summary in summaries:
            if summary[0] not in seen:
                seen.add(summary[0])
                yield summary

    def _index_names(self) -> Iterator[list[Any]]:
        """The lock names in the listing index, a chunk (``HSCAN``) at a time, then an
        empty list."""
        cursor = 0
        epoch_field = self.INDEX_EPOCH_FIELD.encode()
        while True:
            with self._errors("list", self.key_prefix):
                cursor, found = self.client.hscan(self.index_key, cursor, count=self.INDEX_CHUNK)
            names = [name for name in found if name not in (epoch_field, self.INDEX_EPOCH_FIELD)]
            if names:
                yield names
            if not cursor:
                yield []
                return

    def _index_run(self, locks: list[str], names: list[Any]) -> list[Any]:
        """The INDEX script on the lock hashes ``locks`` (with their ``names``, or
        none): what LIST returns of the held ones, not decoded."""
        keys = [self.index_key]
        for key in locks:
            keys += (key, key.removesuffix(":lock") + ":waiters")
        with self._errors("list", self.key_prefix):
            return list(self._run("index", keys, names))

    def _settle(self, names: list[Any]) -> list[Any]:
        """Check the index entries of ``names`` against their locks (one script): drop
        those of free locks, rewrite the others. What LIST returns of the held ones."""
        decoded = [_decode(name) for name in names]
        return self._index_run([self.all_keys(name).lock for name in decoded], decoded)

    def _indexed_summaries(self) -> Iterator[tuple[Any, ...] | LockInfo | str]:
        """:meth:`iter_lock_summaries` from the listing index, a chunk (``HSCAN`` of
        :attr:`INDEX_CHUNK` fields) at a time: each read in one transaction with the
        server's clock, which tells the entries of held locks (expiry after that
        moment) from those to check, and with the index's epoch and marker, which tell
        a whole index from one lost (before the listing, between two of its chunks, or
        its permits set before they are read): the listing then goes on by a walk over
        every key, and says so."""
        doubtful: list[Any] = []
        expired: list[Any] = []
        texts: dict[Any, Any] = {}
        # Names listed or to be checked: HSCAN may return a field twice, and a listing
        # that goes on by a walk skips those it listed.
        seen: set[str] = set()
        epoch: Any = None
        cursor = 0
        while True:
            with self._errors("list", self.key_prefix):
                # MULTI/EXEC: the epoch, the marker and the chunk are of one moment.
                pipe = self.client.pipeline(transaction=True)
                pipe.hget(self.index_key, self.INDEX_EPOCH_FIELD)
                pipe.exists(self.index_marker_key)
                pipe.hscan(self.index_key, cursor, count=self.INDEX_CHUNK)
                pipe.time()
                found, marked, (cursor, entries), (seconds, micros) = pipe.execute()
            built = found is not None or marked
            if found is not None and (not marked or _decode(found).startswith("~")):
                found = None  # not whole: marker lost, or a rebuild not finished
            if not found and epoch is None and not built:
                # Never built here (a new server or prefix, an upgrade), or every trace
                # of it lost: built now, by the walk that lists the locks.
                logger.info("Building the listing index of backend %r", self.alias)
                yield from self._rebuilding_summaries(seen, texts)
                return
            if not found or (epoch is not None and found != epoch):
                if epoch is None:
                    note = (
                        f"The listing index of backend {self.alias!r} was not found whole "
                        f"(never built, or a key of it deleted or evicted): this listing "
                        f"read every key instead, and rebuilt the index."
                    )
                else:
                    note = (
                        f"The listing index of backend {self.alias!r} changed during the "
                        f"listing (a key of it deleted or evicted, or rebuilt): the rest "
                        f"of this listing read every key instead, and rebuilt the index."
                    )
                logger.warning("%s", note)
                yield note
                # Entries read but not listed yet: the walk lists those held.
                seen.difference_update(_decode(name) for name in doubtful + expired)
                yield from self._rebuilding_summaries(seen, texts)
                return
            epoch = found
            now = dt.datetime.now(dt.UTC)
            server_ms = int(seconds) * 1000 + int(micros) // 1000
            shift = (now - _EPOCH) // _MILLISECOND - server_ms  # server clock -> ours
            due, past = server_ms + self.INDEX_MARGIN_MS, server_ms - self.INDEX_MARGIN_MS
            for raw_name, value in entries.items():
                name = raw_name.decode() if type(raw_name) is bytes else raw_name
                if name in seen or name == self.INDEX_EPOCH_FIELD:
                    continue
                parts = value.split(b"\0" if type(value) is bytes else "\0", 9)
                if len(parts) != 10:
                    seen.add(name)
                    doubtful.append(name)  # '': fields holding a NUL; or not an entry
                    continue
                owner, token, host, pid, thread, acquired, expires, ttl, renewals, extra = parts
                try:
                    if expires:
                        expires = int(expires)
                        if expires <= due:
                            if expires >= past:
                                seen.add(name)
                                doubtful.append(name)
                            elif len(expired) < self.INDEX_SETTLE_LIMIT:
                                # Beyond the limit, left out as expired (and not kept:
                                # memory stays bounded); later listings check them.
                                seen.add(name)
                                expired.append(name)
                            continue
                        expires += shift
                        if not _MIN_MS <= expires <= _MAX_MS:
                            expires = None
                    else:
                        expires = None
                    shared = texts.get((host, thread, extra, ttl))
                    if shared is None:
                        if len(texts) > 10_000:
                            texts.clear()  # many different holders: start again
                        shared = texts[host, thread, extra, ttl] = (
                            _decode(host), _decode(thread), _decode(extra),
                            int(ttl or 0) / 1000 or None,
                        )  # fmt: skip
                    acquired = int(acquired) if acquired else None
                    if acquired is not None and not _MIN_MS <= acquired <= _MAX_MS:
                        acquired = None
                    summary = (
                        name,
                        owner.decode() if type(owner) is bytes else owner,
                        int(token or 0), shared[0],
                        int(pid) if pid and pid.isdigit() else None, shared[1], acquired,
                        expires, shared[3], int(renewals or 0), None, shared[2],
                    )  # fmt: skip
                except ValueError:  # not numbers where numbers belong: the lock says
                    seen.add(name)
                    doubtful.append(name)
                    continue
                seen.add(name)
                yield summary
            if not cursor:
                break
        # Entries due now are checked; so are those whose expiry is past, up to a limit
        # (those left are of locks that expired: the next listings drop them).
        check = doubtful + expired
        for start in range(0, len(check), self.LIST_BATCH):
            values = self._settle(check[start : start + self.LIST_BATCH])
            now = dt.datetime.now(dt.UTC)
            yield from _summaries(values, (now - _EPOCH) // _MILLISECOND, texts)
        with self._errors("list", self.key_prefix):
            whole = self.client.sismember(
                self.index_permits_key, f"{self.INDEX_EPOCH_FIELD}:{_decode(epoch)}"
            )
        if not whole:
            note = (
                f"The permits set of the listing index of backend {self.alias!r} was lost "
                f"(deleted or evicted): this listing read every key for them instead, and "
                f"rebuilt the index."
            )
            logger.warning("%s", note)
            yield note
            yield from self._rebuilding_summaries(seen, texts)
            return
        yield from self.indexed_permits()

    def count_waiters(self, names: Sequence[str]) -> list[int]:
        """How many waiters are registered on each lock of ``names`` (in one round
        trip): what a listing read from the index leaves out, for the rows shown."""
        with self._errors("list", self.key_prefix):
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.zcard(self.all_keys(name).waiters)
            return [int(count) for count in pipe.execute()]

    def _walk(self) -> Iterator[tuple[list[str], dict[str, list[str]] | None]]:
        """The lock hashes of this backend, a SCAN batch at a time, then (with the last,
        empty batch) the bases of its semaphores and read-write locks."""
        permits: dict[str, list[str]] = {SEMAPHORE: [], RWLOCK: []}
        for batch in self._scan_batches(self._hash_pattern(), kind="hash"):
            locks = []
            for key in batch:
                if key.endswith(":lock"):
                    locks.append(key)
                elif key.endswith(":sem:info"):
                    permits[SEMAPHORE].append(key.removesuffix(":sem:info"))
                elif key.endswith(":rw:info"):
                    permits[RWLOCK].append(key.removesuffix(":rw:info"))
            yield locks, None
        yield [], permits

    def _hash_pattern(self) -> str:
        """A SCAN pattern for this backend's keys, and no other prefix's."""
        # Glob characters in the prefix must match themselves.
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", self.key_prefix)
        return f"{prefix}:{{*}}:*"

    def _describe(self, locks: list[str]) -> Iterator[LockInfo]:
        """The live ones of the lock hashes ``locks``, read in one round trip."""
        values, now = self._list_values(locks)
        for at in range(0, len(values), _WIDTH):
            yield self._info(values, at, now)

    def _list_values(self, locks: list[str], decode: bool = True) -> tuple[list[Any], dt.datetime]:
        """What INSPECT reads of each live one of the lock hashes ``locks``, one after
        the other (strings decoded, unless ``decode`` is false), read in one round trip;
        and when they were read."""
        with self._errors("list", self.key_prefix):
            if self.mode == "cluster":
                # Keys of many slots: a pipeline, which sends each node the keys it serves.
                pipe = self.client.pipeline(transaction=False)
                for key in locks:
                    pipe.hmget(key, _FIELDS)
                    pipe.pttl(key)
                    pipe.zcard(key.removesuffix(":lock") + ":waiters")
                replies = pipe.execute()
                values: list[Any] = []
                for at in range(0, len(replies), 3):
                    if replies[at][0] is not None:
                        values += [*replies[at], replies[at + 1], replies[at + 2]]
            else:
                keys: list[str] = []
                for key in locks:
                    keys += (key, key.removesuffix(":lock") + ":waiters")
                values = self._run("list", keys, [])
        return _decoded(values) if decode else values, dt.datetime.now(dt.UTC)

    def _scan_batches(self, pattern: str, *, kind: str | None = None) -> Iterator[list[str]]:
        """The keys matching ``pattern`` (of the type ``kind``, if given), in batches:
        SCAN, so the server is never blocked for long."""
        size = self.SCAN_COUNT
        with self._errors("list", pattern):
            if self.mode == "cluster":
                # Each primary holds only its own slots' keys: scan every one of them.
                batch: list[str] = []
                for key in self.client.scan_iter(
                    match=pattern,
                    count=size,
                    _type=kind,
                    target_nodes=redis.cluster.RedisCluster.PRIMARIES,
                ):
                    batch.append(_decode(key))
                    if len(batch) >= size:
                        yield batch
                        batch = []
                if batch:
                    yield batch
                return
            cursor = 0
            while True:
                cursor, keys = self.client.scan(
                    cursor=cursor, match=pattern, count=size, _type=kind
                )
                if keys:
                    yield [_decode(key) for key in keys]
                if cursor == 0:
                    break
