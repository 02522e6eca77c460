"""The Lua scripts of the Redis backend's semaphores and read-write locks (text
only, no I/O); :mod:`.permits` runs them. The key layout is in that module's
docstring.
"""

from __future__ import annotations

from distlocks.backends.redis.index_scripts import _SWEEP, INDEX_SWEEP_EVERY
from distlocks.backends.redis.scripts import (
    _ATTEMPTS,
    _COUNTER,
    _KINDS,
    FENCE_GRACE_MS,
)

_COMMON = (
    _KINDS
    + _ATTEMPTS
    + _SWEEP
    + """
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

-- The listing index's set of permit names (the key given, or nil without the index)
-- loses the name whose last permit was given back: a per-call name leaves no member.
local function unlist(index, info)
  if index and redis.call('EXISTS', info) == 0 then redis.call('SREM', index, info) end
end

-- A release's tombstone (see the lock's RELEASE script), the key given: a release
-- request sent again after its reply was lost finds the id it was sent with there.
local function mark_released(tombstone, request)
  if request then redis.call('SET', tombstone, request, 'PX', FENCE_GRACE_MS) end
end
local function released_by(tombstone, request)
  return request and redis.call('GET', tombstone) == request
end

-- One more wake-up, keeping no more of them than there are waiters.
local function signal(list, waiters)
  if waiters <= 0 then return end
  redis.call('RPUSH', list, 1)
  redis.call('LTRIM', list, -waiters, -1)
  redis.call('PEXPIRE', list, 10000)
end

-- The listing index's permits set (the key given) swept as the lock index is (see
-- INDEX_SWEEP_EVERY in .scripts): about one grant in INDEX_SWEEP_EVERY (those whose
-- server clock is a multiple of it in microseconds: as good as random, and no counter)
-- reads the next INDEX_SWEEP_COUNT or so members (SSCAN, from the cursor kept in the
-- string '<set>:sweep') and drops those whose info hash and holders are both gone (every
-- permit of the name ran out unreleased: the keys expire with the last one). Run after a
-- grant added its own member, which established the set's type; its reads are pcall()s
-- all the same, so that nothing here fails a grant already written.
local function permits_sweep(index)
  if now[2] % INDEX_SWEEP_EVERY ~= 0 then return end
  sweep_step(index, 'SSCAN', 'SREM', function(members)
    local gone = {}
    for _, info in ipairs(members) do
      -- Members other than info hashes (the index's epoch) are the listing's.
      local suffix = string.match(info, ':(%a+):info$')
      if (suffix == 'sem' or suffix == 'rw')
          and redis.call('EXISTS', info, string.sub(info, 1, -6)) == 0 then
        gone[#gone + 1] = info
      end
    end
    return gone
  end)
end

local function holder_json(raw, kind, token, ttl, rid)
  local h = cjson.decode(raw)
  h.attempts = (rid == nil or rid == '') and '*' or rid
  h.kind = kind
  -- Strings: cjson would round numbers of more than 14 digits.
  h.token = string.format('%d', token)
  h.acquired_at = string.format('%d', now_ms)
  h.ttl = ttl
  h.renewals = 0
  return cjson.encode(h)
end

-- A permit granted again to its owner (``raw``: its details, read before the call's
-- first write): the request ``rid`` is one more it was granted by.
local function granted_again(info, owner, raw, rid)
  if not raw then return end
  local h = cjson.decode(raw)
  h.attempts = attempts_with(h.attempts, rid or '')
  redis.call('HSET', info, owner, cjson.encode(h))
end

-- The give-back of the acquire request ``rid`` of a permit of ``owner`` (see GIVE_BACK
-- in .scripts): true when the permit is to be released (no other request it was
-- granted by is left); otherwise it writes the requests left, if any changed.
local function giving_back(info, owner, rid, kind)
  local raw = redis.call('HGET', info, owner)
  if not raw then return false end
  local h = cjson.decode(raw)
  if kind and h.kind ~= kind then return false end
  local left = attempts_without(h.attempts, rid)
  if left == nil then return false end
  if left == '' then return true end
  h.attempts = left
  redis.call('HSET', info, owner, cjson.encode(h))
  return false
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
""".replace("FENCE_GRACE_MS", str(FENCE_GRACE_MS)).replace(
        "INDEX_SWEEP_EVERY", str(INDEX_SWEEP_EVERY)
    )
)

# -- semaphores. KEYS: holders, info, waiters, signal. ------------------------------

# ARGV: owner, ttl ms, limit, holder JSON, registration ms (0: not waiting), the
# request's id (see _ATTEMPTS in .scripts).
# Returns {1, 0, ttl ms} when granted; {0, 0, ms until the first permit ends} when not.
SEM_ACQUIRE = (
    _COMMON
    + """
purge(KEYS[1], KEYS[2])
local owner, ttl = ARGV[1], tonumber(ARGV[2])
-- Each command that can fail (a key of the wrong type) runs before the permit is
-- written (see "Half-written" in .scripts): a failure grants nothing.
if redis.call('ZSCORE', KEYS[1], owner) then
  -- A retried request whose first reply was lost, or the owner acquiring again: it
  -- is ours, and this request is one more it was granted by.
  local raw = redis.call('HGET', KEYS[2], owner)
  if KEYS[5] then redis.call('SADD', KEYS[5], KEYS[2]) end
  granted_again(KEYS[2], owner, raw, ARGV[6])
  redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
  tidy(KEYS[1], KEYS[2])
  if KEYS[5] then permits_sweep(KEYS[5]) end
  return {1, 0, ttl}
end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  if KEYS[5] then redis.call('SADD', KEYS[5], KEYS[2]) end
  redis.call('ZREM', KEYS[3], owner)
  redis.call('HSET', KEYS[2], owner, holder_json(ARGV[4], 'semaphore', 0, ttl, ARGV[6]))
  redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
  tidy(KEYS[1], KEYS[2])
  if KEYS[5] then permits_sweep(KEYS[5]) end
  return {1, 0, ttl}
end
if tonumber(ARGV[5]) > 0 then register(KEYS[3], owner, tonumber(ARGV[5])) end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, 0, math.floor(tonumber(first[2]) - now_ms)}
"""
)

# KEYS[5]: the owner's release tombstone (holders key .. ':released:' .. owner)[, KEYS[6]:
# the listing index's set of permit names].
# ARGV: owner[, request id]. Gives back the caller's own live permit only; wakes one
# waiter. With a request id, answers 1 to the same request sent again (its tombstone).
SEM_RELEASE = (
    _COMMON
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
purge(KEYS[1], KEYS[2])
if not score or tonumber(score) <= now_ms then
  if released_by(KEYS[5], ARGV[2]) then return 1 end
  return 0
end
-- What can fail first, the permit given back last (see "Half-written" in .scripts):
-- the wake-up (waiters, signal list), then the permits set probed (SCARD) before the
-- holder's details go: the info hash without the owner tells whether this was the
-- name's last permit, and its SREM must not fail after that.
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
signal(KEYS[4], redis.call('ZCARD', KEYS[3]))
if KEYS[6] then redis.call('SCARD', KEYS[6]) end
redis.call('HDEL', KEYS[2], ARGV[1])
unlist(KEYS[6], KEYS[2])
mark_released(KEYS[5], ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
tidy(KEYS[1], KEYS[2])
return 1
"""
)

# KEYS as SEM_RELEASE's. ARGV: owner, then the id of the acquire request to give back.
# The give-back of a permit acquire left unanswered: it releases the permit only if no
# other request of the owner was granted it too (see GIVE_BACK in .scripts); no
# tombstone. The request's id is taken off ARGV first: SEM_RELEASE sees no request id.
SEM_GIVE_BACK = (
    """
local rid = table.remove(ARGV)
"""
    + _COMMON
    + """
if not giving_back(KEYS[2], ARGV[1], rid) then return 0 end
"""
    + SEM_RELEASE.removeprefix(_COMMON)
)

# ARGV: owner, ttl ms.
SEM_EXTEND = (
    _COMMON
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now_ms then return 0 end
renewed(KEYS[2], ARGV[1], tonumber(ARGV[2]))  -- can fail: before the renewal
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
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

# [KEYS[5]: the listing index's set of permit names.] ARGV: owner, or '' for every
# permit. Returns how many live permits were evicted.
SEM_FORCE = (
    _COMMON
    + """
kinds(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'zset', KEYS[4], 'list', KEYS[5], 'set')
purge(KEYS[1], KEYS[2])
-- What can fail first, the eviction last (see "Half-written" in .scripts).
local evicted
if ARGV[1] == '' then
  evicted = redis.call('ZCARD', KEYS[1])
  if KEYS[5] then redis.call('SREM', KEYS[5], KEYS[2]) end
else
  evicted = redis.call('ZSCORE', KEYS[1], ARGV[1]) and 1 or 0
  redis.call('HDEL', KEYS[2], ARGV[1])
  unlist(KEYS[5], KEYS[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
for _ = 1, evicted do signal(KEYS[4], redis.call('ZCARD', KEYS[3])) end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  tidy(KEYS[1], KEYS[2])
end
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
    + _COUNTER
    + """
-- The write counter (KEYS[8]) is kept until the last lease on the name ends and the
-- server clock has passed its value; then a counter started afresh from the clock is
-- above every token issued before (2 ms spare for the rounding), and for the grace
-- the plain lock's counter gets too. Called after every change of the leases' ends
-- and of the counter.
-- The write counter's value (false: there is none), checked to be a number: read before
-- the write that decides a call's outcome, so that keep_fence(value) after it cannot fail.
local function read_fence()
  local value = redis.call('GET', KEYS[8])
  if value then counter(KEYS[8], value) end
  return value
end

-- ``value``: the counter's, when the caller read it already (false: there is none).
local function keep_fence(value)
  if value == nil then value = redis.call('GET', KEYS[8]) end
  if not value then return end
  local at = math.max(math.floor(counter(KEYS[8], value) / 1000) + 2, now_ms + FENCE_GRACE_MS)
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if #last > 0 then at = math.max(at, math.ceil(tonumber(last[2]))) end
  redis.call('PEXPIRE', KEYS[8], math.max(1, at - now_ms))
end

-- The next write token: as for a lock, one more than the last and never below the
-- server clock in microseconds, so a lost (or expired) counter cannot make tokens
-- go back.
local function next_token(fence, value)
  if value == nil then value = redis.call('GET', fence) end
  local token = math.max(counter(fence, value or '0') + 1, now[1] * 1000000 + now[2])
  redis.call('SET', fence, string.format('%d', token))
  keep_fence(string.format('%d', token))
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
-- Called before the leases ending (so that its pushes, which can fail, come first):
-- ``writer_leaves`` (the writer is among them) and ``leaving`` (how many) say what
-- is left after them.
local function wake_rw(writer_leaves, leaving)
  if not writer_leaves and redis.call('EXISTS', KEYS[3]) == 1 then return end
  local writers = redis.call('ZCARD', KEYS[4])
  if writers > 0 then
    if redis.call('ZCARD', KEYS[1]) - (leaving or 0) <= 0 then signal(KEYS[6], writers) end
    return
  end
  local readers = redis.call('ZCARD', KEYS[5])
  for _ = 1, math.min(readers, 1000) do signal(KEYS[7], readers) end
end
""".replace("FENCE_GRACE_MS", str(FENCE_GRACE_MS))
)

# ARGV: kind ('read' or 'write'), owner, ttl ms, holder JSON, registration ms, the
# request's id (see _ATTEMPTS in .scripts).
# Returns {1, token, ttl ms} when granted (token 0 for a reader); {0, 0, ms until the
# lease in the way ends, or -3 when a waiting writer is in the way} when not.
RW_ACQUIRE = (
    _RW
    + """
local writer = purge_rw()
local kind, owner, ttl, reg = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
-- Each command that can fail (a key of the wrong type) runs before the lease is
-- written (see "Half-written" in .scripts): a failure grants nothing.
if redis.call('ZSCORE', KEYS[1], owner) then
  -- A retried request whose first reply was lost, or the owner acquiring again: it
  -- is ours, and this request is one more it was granted by.
  local fence = read_fence()
  local raw = redis.call('HGET', KEYS[2], owner)
  if KEYS[9] then redis.call('SADD', KEYS[9], KEYS[2]) end
  local token = 0
  if writer == owner then
    token = tonumber(cjson.decode(raw).token)
  end
  granted_again(KEYS[2], owner, raw, ARGV[6])
  redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
  tidy(KEYS[1], KEYS[2], KEYS[3])
  keep_fence(fence)
  if KEYS[9] then permits_sweep(KEYS[9]) end
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
local fence = read_fence()
if KEYS[9] then redis.call('SADD', KEYS[9], KEYS[2]) end
local token = 0
if kind == 'write' then
  token = next_token(KEYS[8], fence)
  fence = string.format('%d', token)
end
redis.call('HSET', KEYS[2], owner, holder_json(ARGV[4], kind, token, ttl, ARGV[6]))
if kind == 'write' then
  redis.call('SET', KEYS[3], owner)
  redis.call('ZREM', KEYS[4], owner)
else
  redis.call('ZREM', KEYS[5], owner)
end
redis.call('ZADD', KEYS[1], now_ms + ttl, owner)
tidy(KEYS[1], KEYS[2], KEYS[3])
keep_fence(fence)
if KEYS[9] then permits_sweep(KEYS[9]) end
return {1, token, ttl}
"""
)

# KEYS[9]: the owner's release tombstone (holders key .. ':released:' .. owner)[, KEYS[10]:
# the listing index's set of permit names]. ARGV: kind, owner[, request id]. Gives back
# the caller's own live lease of that kind only. With a request id, answers 1 to the
# same request sent again (its tombstone).
RW_RELEASE = (
    _RW
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
local writer = purge_rw()
if not score or tonumber(score) <= now_ms or (ARGV[1] == 'write') ~= (writer == ARGV[2]) then
  if released_by(KEYS[9], ARGV[3]) then return 1 end
  return 0
end
-- What can fail first, the lease given back last (see "Half-written" in .scripts).
local fence = read_fence()
-- The wake-up first, then the permits set probed (SCARD) before the holder's details
-- go, as in SEM_RELEASE.
wake_rw(writer == ARGV[2], 1)
if KEYS[10] then redis.call('SCARD', KEYS[10]) end
redis.call('HDEL', KEYS[2], ARGV[2])
unlist(KEYS[10], KEYS[2])
mark_released(KEYS[9], ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[2])
if writer == ARGV[2] then redis.call('DEL', KEYS[3]) end
tidy(KEYS[1], KEYS[2], KEYS[3])
keep_fence(fence)  -- down to the leases left: a long released one no longer counts
return 1
"""
)

# KEYS as RW_RELEASE's. ARGV: kind, owner, then the id of the acquire request to give
# back: SEM_GIVE_BACK for a read-write lock.
RW_GIVE_BACK = (
    """
local rid = table.remove(ARGV)
"""
    + _RW
    + """
if not giving_back(KEYS[2], ARGV[2], rid, ARGV[1]) then return 0 end
"""
    + RW_RELEASE.removeprefix(_RW)
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
-- What can fail first, the renewal last (see "Half-written" in .scripts).
local fence = read_fence()
renewed(KEYS[2], ARGV[2], tonumber(ARGV[3]))
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[2])
tidy(KEYS[1], KEYS[2], KEYS[3])
keep_fence(fence)
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

# [KEYS[9]: the listing index's set of permit names.]
# ARGV: owner, or '' for every lease. The write counter moves on in any case, so an
# evicted writer's token is outdated. Returns how many live leases were evicted.
RW_FORCE = (
    _RW
    + """
kinds(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'string', KEYS[4], 'zset', KEYS[5], 'zset',
      KEYS[6], 'list', KEYS[7], 'list', KEYS[8], 'string', KEYS[9], 'set')
local writer = purge_rw()
-- What can fail first, the eviction last (see "Half-written" in .scripts). The counter
-- moves on first: kept for the evicted leases too, which is only longer.
next_token(KEYS[8])
local evicted
if ARGV[1] == '' then
  evicted = redis.call('ZCARD', KEYS[1])
  if KEYS[9] then redis.call('SREM', KEYS[9], KEYS[2]) end
  wake_rw(true, evicted)
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
else
  evicted = redis.call('ZSCORE', KEYS[1], ARGV[1]) and 1 or 0
  redis.call('HDEL', KEYS[2], ARGV[1])
  unlist(KEYS[9], KEYS[2])
  wake_rw(writer == ARGV[1], evicted)
  redis.call('ZREM', KEYS[1], ARGV[1])
  if writer == ARGV[1] then redis.call('DEL', KEYS[3]) end
  tidy(KEYS[1], KEYS[2], KEYS[3])
end
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
