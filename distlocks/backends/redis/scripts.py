"""The Lua scripts of the Redis backend's locks, and the fencing counter's grace;
text only, no I/O. Each operation that must be atomic is one of these scripts,
run by :mod:`.calls` (the key layout they expect is in :mod:`.keys`).
"""

from __future__ import annotations

# The sweep's numbers are also read from here (the permits' scripts, tests).
from distlocks.backends.redis.index_scripts import (  # noqa: F401
    _INDEX_SWEEP,
    INDEX_PRUNE_AFTER_MS,
    INDEX_SWEEP_COUNT,
    INDEX_SWEEP_EVERY,
)

#: How long a fencing counter is kept past its last change at the least (ms), by the
#: plain lock's scripts below and the read-write lock's (:mod:`.permit_scripts`).
FENCE_GRACE_MS = 5000

# Half-written: a key of the wrong type (something else wrote a string where the index
# hash belongs, ...) makes the command on it fail, and a Lua script that fails keeps the
# writes it made before. So in every script below, each command that can fail runs
# before the write that decides what the caller is told (the grant, the release, the
# renewal, the eviction), and the commands after it cannot fail: they work on keys of any
# type (SET, DEL, PEXPIRE) or on keys an earlier command of the script read or wrote.
# What may come before is tidying that leaves nothing half-done: pruned registrations,
# a fencing counter moved on or kept longer, a waiter woken (it finds the lock as it
# is). A failure then changes nothing the caller counts on (tests/test_redis_halfwritten.py),
# and the error names the key (RedisCalls._error).

# Shared Lua fragments. Waiters register in KEYS waiters (zset owner -> expiry ms);
# fair waiters also queue in KEYS queue (zset owner -> arrival time in us).
# Each key of the call that can hold a value of another type than distlocks keeps
# there (something else wrote it) fails the call here, before its first write: a
# command on the key that fails on another type (WRONGTYPE, which the client names).
# Ordering the writes after every read that can fail is not enough: a release or an
# eviction writes to several keys, and any of them can be the one of the wrong type.
# kinds(key, 'hash', key, 'zset', ...); a nil key (an optional one) is skipped.
_KINDS = """
local KIND_PROBE = {hash = 'HLEN', string = 'STRLEN', zset = 'ZCARD', set = 'SCARD',
                    list = 'LLEN'}
local function kinds(...)
  for i = 1, select('#', ...), 2 do
    local key, want = select(i, ...)
    if key then redis.call(KIND_PROBE[want], key) end
  end
end
"""

_NOW = """
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
"""

# A fencing counter's value as a number; a value that is none (something else wrote the
# key) fails the script, before its first write, with an error that names the key.
_COUNTER = """
local function counter(fence, value)
  local n = tonumber(value)
  if n == nil then
    error('key ' .. fence .. ' holds a value that is not a number, where distlocks keeps a '
      .. 'fencing counter: something other than distlocks wrote it. Delete it (DEL) and '
      .. 'try again; this call changed nothing it reports.', 0)
  end
  return n
end
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
_NEXT_TOKEN = (
    _COUNTER
    + """
local function fence_ms(lease_end_ms, now_ms, value)
  -- 2 ms spare: the division rounds, and the expiry counts from the command's time.
  local at = math.max(lease_end_ms, math.floor(value / 1000) + 2, now_ms + FENCE_GRACE_MS)
  return math.max(1, at - now_ms)
end
local function keep_fence(fence, lease_end_ms, now_ms)
  local value = redis.call('GET', fence)
  if not value then return end
  redis.call('PEXPIRE', fence, fence_ms(lease_end_ms, now_ms, counter(fence, value)))
end
-- The new value and its expiry in one SET (PX), the same as keep_fence() after it.
local function next_token(fence, now, lease_end_ms)
  local token = math.max(counter(fence, redis.call('GET', fence) or '0') + 1,
                         now[1] * 1000000 + now[2])
  local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
  redis.call('SET', fence, string.format('%d', token), 'PX',
             fence_ms(lease_end_ms, now_ms, token))
  return token
end
""".replace("FENCE_GRACE_MS", str(FENCE_GRACE_MS))
)

# A released lease's tombstone: the key ``<base>:released:<owner>``, holding the id of
# the release request that wrote it, kept FENCE_GRACE_MS. A request sent again because
# its reply was lost (the connection broke after the server ran it: the client
# reconnects and sends the very same request at once) finds the lock gone, or someone
# else's: the tombstone tells it that its own first run released it, where the caller
# would otherwise be told its lease was lost. A new release call has a new id, so a
# release repeated on purpose (or of a later lease of the same owner that was lost) is
# still answered "not held". The key is declared (KEYS) like the lock's others.

# The requests a lock or permit was granted by: a grant records the id of its request
# (ARGV[9] after the fair flag: the argument list is the one the Celery scripts extend),
# a grant to the owner that holds it already (a retry, or the same owner acquiring
# again: owners are reused, a queue marker's is the task id) adds its own, and the
# give-back of an acquire left unanswered (GIVE_BACK) takes back only its request's:
# the entry goes only when no request it was granted by is left. So a late acquire,
# and its give-back behind it, cannot release what a newer request of the same owner
# was told it holds, whichever of them reaches the server first, and a request sent
# again with its id (its first reply lost) is answered as granted, as before. '*' (kept
# with the others) stands for the requests no longer listed: past ATTEMPTS_KEPT ids
# (the same owner acquiring again and again) and entries written without ids; with it
# the entry never goes by a give-back (its ttl or a release ends it).
ATTEMPTS_KEPT = 8
_ATTEMPTS = """
local function attempts_with(ids, rid)
  if rid == '' then rid = '*' end
  local n = 0
  for id in string.gmatch(ids or '*', '%S+') do
    if id == rid then return ids end
    n = n + 1
  end
  if n >= ATTEMPTS_KEPT then return '*' end
  return (ids or '*') .. ' ' .. rid
end
-- The ids left once ``rid`` is taken back (nil when it was not among them).
local function attempts_without(ids, rid)
  local left, found = {}, false
  for id in string.gmatch(ids or '*', '%S+') do
    if id == rid then found = true else left[#left + 1] = id end
  end
  if not found then return nil end
  return table.concat(left, ' ')
end
""".replace("ATTEMPTS_KEPT", str(ATTEMPTS_KEPT))

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
-- The index entry of a held lock rewritten from its hash, with the expiry given; and
-- with the ttl, one more renewal and the details the caller is about to write to the
-- hash, if given (it is written before the lock: see "Half-written" above).
local function reindex(index, lock, name, expires, ttl, renewed, extra)
  local f = redis.call('HMGET', lock, 'owner', 'token', 'host', 'pid', 'thread',
    'acquired_at', 'ttl', 'renewals', 'extra')
  local renewals = f[8] or ''
  if renewed then renewals = string.format('%d', (tonumber(f[8]) or 0) + 1) end
  redis.call('HSET', index, name, entry({f[1] or '', f[2] or '', f[3] or '', f[4] or '',
    f[5] or '', f[6] or '', expires, ttl or f[7] or '', renewals, extra or f[9] or ''}))
end
local function ms_now()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
"""

# KEYS: lock hash, fence counter, waiters, queue[, listing index].
# ARGV: owner, ttl ms, name, host, pid, thread, extra (JSON), wait ms, fair (0/1) and
# the request's id right after it (see _ATTEMPTS). ARGV[3] (the name) is also the
# index field.
# Returns {1, token, ttl ms} when granted; {0, 0, holder's pttl or -3} when not.
ACQUIRE = (
    _NOW
    + _NEXT_TOKEN
    + _PRUNE
    + _ENTRY
    + _INDEX_SWEEP
    + _ATTEMPTS
    + """
local rid = string.sub(ARGV[9], 2)
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == ARGV[1] then
  -- Same owner: a retried request whose first reply was lost, or the owner acquiring
  -- again. It is ours, and this request is one the entry was granted by.
  keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
  if KEYS[5] then
    reindex(KEYS[5], KEYS[1], ARGV[3], string.format('%d', now_ms + tonumber(ARGV[2])))
  end
  redis.call('HSET', KEYS[1], 'attempts',
             attempts_with(redis.call('HGET', KEYS[1], 'attempts'), rid))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token')), tonumber(ARGV[2])}
end
local fair = string.sub(ARGV[9], 1, 1) == '1'
local wait_ms = tonumber(ARGV[8])
local turn = not holder
if turn and fair then
  prune(KEYS[3], KEYS[4], now_ms)
  local head = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
  turn = (not head) or head == ARGV[1]
end
if not turn then
  if wait_ms > 0 then
    -- The sets expire with their latest registration: those of a waiter that crashed
    -- go even if no script on this name ever runs again to prune them.
    redis.call('ZADD', KEYS[3], now_ms + wait_ms, ARGV[1])
    if redis.call('PTTL', KEYS[3]) < wait_ms then redis.call('PEXPIRE', KEYS[3], wait_ms) end
    if fair then
      redis.call('ZADD', KEYS[4], 'NX', now[1] * 1000000 + now[2], ARGV[1])
      if redis.call('PTTL', KEYS[4]) < wait_ms then redis.call('PEXPIRE', KEYS[4], wait_ms) end
    end
  end
  if holder then return {0, 0, redis.call('PTTL', KEYS[1])} end
  return {0, 0, -3}
end
-- Always (a last attempt made with no time left registers nothing, but an earlier
-- attempt of the same caller may have): no stale registration stays behind.
redis.call('ZREM', KEYS[3], ARGV[1])
if fair then redis.call('ZREM', KEYS[4], ARGV[1]) end
local token = next_token(KEYS[2], now, now_ms + tonumber(ARGV[2]))
if KEYS[5] then
  -- entry() written out: the texts given are the only fields that may hold a NUL.
  -- Before the lock: an index of the wrong type fails the call with nothing granted.
  local value = ''
  if not string.find(ARGV[1] .. ARGV[4] .. ARGV[5] .. ARGV[6], '\\0', 1, true) then
    value = ARGV[1] .. '\\0' .. string.format('%d', token) .. '\\0' .. ARGV[4] .. '\\0'
      .. ARGV[5] .. '\\0' .. ARGV[6] .. '\\0' .. string.format('%d', now_ms) .. '\\0'
      .. string.format('%d', now_ms + tonumber(ARGV[2])) .. '\\0' .. ARGV[2] .. '\\0' .. '0\\0'
      .. ARGV[7]
  end
  redis.call('HSET', KEYS[5], ARGV[3], value)
end
redis.call('HSET', KEYS[1],
  'owner', ARGV[1], 'token', token, 'name', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'thread', ARGV[6], 'extra', ARGV[7], 'ttl', ARGV[2], 'renewals', 0,
  'acquired_at', now_ms, 'attempts', rid == '' and '*' or rid)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if KEYS[5] then index_sweep(KEYS[5], now_ms, token) end
return {1, token, tonumber(ARGV[2])}
"""
)


# KEYS: lock hash, waiters, queue, signal, fence counter, tombstone[, listing index].
# ARGV: owner, wake key prefix[, name: the index field, with the index ('' without it),
# request id].
# Compare-and-delete, then wake one waiter. No lease is live any more: the counter is
# kept only until the clock passes it (and the grace), not until the lease would have
# ended, so a per-call name with a long ttl goes soon after its release. With a request
# id it leaves the owner's tombstone, and a repeated request that finds it answers 1.
# (Redlock's give-back sends an attempt id as ARGV[3] and no request id.)
RELEASE = (
    _WAKE
    + _NOW
    + _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  if ARGV[4] and redis.call('GET', KEYS[6]) == ARGV[4] then return 1 end
  return 0
end
keep_fence(KEYS[5], 0, now_ms)
if redis.call('EXISTS', KEYS[2]) == 1 then
  wake(KEYS[2], KEYS[3], KEYS[4], ARGV[2], now_ms)
end
if KEYS[7] then redis.call('HDEL', KEYS[7], ARGV[3]) end
redis.call('DEL', KEYS[1])
if ARGV[4] then redis.call('SET', KEYS[6], ARGV[4], 'PX', FENCE_GRACE_MS) end
return 1
""".replace("FENCE_GRACE_MS", str(FENCE_GRACE_MS))
)

# KEYS as RELEASE's. ARGV: owner, wake key prefix, name (as RELEASE's), then the id of
# the acquire request to give back (see _ATTEMPTS). The give-back of an acquire left
# unanswered, sent behind it on its connection (or on another one if that broke): it
# takes back only what that request was granted, so it releases the lock only if no
# other request of the owner was granted it too (a retry with another id, the same
# owner acquiring again); it leaves no tombstone (it releases no lease anyone counts
# on). Returns 1 if it released the lock. Redlock's masters run it too (ARGV[3]: the
# attempt's id, unused here), where an entry its lease renewed ('attempt' = 'lease')
# is never given back.
GIVE_BACK = (
    _ATTEMPTS
    + """
local rid = table.remove(ARGV)
local entry = redis.call('HMGET', KEYS[1], 'owner', 'attempts', 'attempt')
if entry[1] ~= ARGV[1] or entry[3] == 'lease' then return 0 end
local left = attempts_without(entry[2], rid)
if left == nil then return 0 end
if left ~= '' then
  redis.call('HSET', KEYS[1], 'attempts', left)
  return 0
end
"""
    + RELEASE
)

# KEYS: lock hash, fence counter[, listing index]. ARGV: owner, ttl ms[, name].
# Compare-and-expire; the counter is kept at least as long as the lease.
EXTEND = (
    _ENTRY
    + _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  local now_ms = ms_now()
  keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
  if KEYS[3] then
    reindex(KEYS[3], KEYS[1], ARGV[3], string.format('%d', now_ms + tonumber(ARGV[2])),
            ARGV[2], true)
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
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
  keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)
  local extra = redis.call('HGET', KEYS[1], 'extra') or ''
  if not string.find(extra, '"kept": true', 1, true) then
    if extra == '' or extra == '{}' then
      extra = '{"kept": true}'
    elseif string.sub(extra, 1, 1) == '{' then
      extra = '{"kept": true, ' .. string.sub(extra, 2)
    end
  end
  if KEYS[3] then
    reindex(KEYS[3], KEYS[1], ARGV[3], string.format('%d', now_ms + tonumber(ARGV[2])),
            ARGV[2], false, extra)
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2], 'extra', extra)
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
-- The index is every lease's: one of the wrong type fails the call, before any write.
if index then redis.call('HLEN', index) end
local now_ms = ms_now()
-- A lease whose own key holds a value of another type gets -1 (the client makes it a
-- LockError naming the key) and the others their outcome, as if it were not here:
-- raising would fail the whole batch after the leases before it were renewed.
local function wrong(reply) return type(reply) == 'table' and reply.err ~= nil end
for i = 1, n do
  local owner, ttl = ARGV[3 * i - 2], ARGV[3 * i - 1]
  local holder = redis.pcall('HGET', KEYS[i], 'owner')
  if wrong(holder) or (holder == owner and wrong(redis.pcall('STRLEN', KEYS[n + i]))) then
    out[i] = -1
  elseif holder == owner then
    keep_fence(KEYS[n + i], now_ms + tonumber(ttl), now_ms)
    if index then
      reindex(index, KEYS[i], ARGV[3 * i], string.format('%d', now_ms + tonumber(ttl)), ttl,
              true)
    end
    redis.call('PEXPIRE', KEYS[i], ttl)
    redis.call('HSET', KEYS[i], 'ttl', ttl)
    redis.call('HINCRBY', KEYS[i], 'renewals', 1)
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
    _KINDS
    + _NOW
    + _NEXT_TOKEN
    + _WAKE
    + """
kinds(KEYS[1], 'hash', KEYS[2], 'string', KEYS[3], 'zset', KEYS[4], 'zset', KEYS[5], 'list',
      KEYS[6], 'hash')
local token = redis.call('HGET', KEYS[1], 'token')
if not token then return 0 end
if ARGV[2] ~= '' and tonumber(token) ~= tonumber(ARGV[2]) then return 0 end
next_token(KEYS[2], now, 0)
wake(KEYS[3], KEYS[4], KEYS[5], ARGV[1], now_ms)
if KEYS[6] then redis.call('HDEL', KEYS[6], ARGV[3]) end
redis.call('DEL', KEYS[1])
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
redis.call('SADD', KEYS[2], ARGV[1] .. ':' .. ARGV[2])
if old then redis.call('SREM', KEYS[2], ARGV[1] .. ':' .. old) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
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
    "give_back": GIVE_BACK,
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
