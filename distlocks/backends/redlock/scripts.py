"""The Redlock backend's Lua scripts, free of I/O: what each one does on one master.

Each master runs the single-node scripts of :mod:`distlocks.backends.redis` for what
they already do (release, force release, leaving the wait queue); the ones here wrap
or add to them for the quorum: an acquire that knows attempts, the confirmation of a
grant, the give-back of a failed attempt, and renewals that make an entry the lease's.
"""

from __future__ import annotations

from distlocks.backends.redis import _ATTEMPTS, _KINDS, _NEXT_TOKEN
from distlocks.backends.redis import ACQUIRE as SINGLE_ACQUIRE
from distlocks.backends.redis import GIVE_BACK as SINGLE_GIVE_BACK

# Every request of an acquisition attempt carries the attempt's id, and every entry
# records the id of the step of its owner that last made it its own: an attempt
# (ids grow, see _next_attempt) or, once renewed, the lease ('lease'). A request of
# an older step than the entry's is stale: it changes nothing.
_OURS = """
local function ours(lock, owner, attempt)
  local entry = redis.call('HMGET', lock, 'owner', 'attempt')
  if entry[1] ~= owner then return false end
  return entry[2] ~= 'lease' and (tonumber(entry[2]) or 0) <= tonumber(attempt)
end
"""

# KEYS and ARGV as the single-node acquire, plus a last ARGV: the attempt id; the
# request id after the fair flag is the attempt's (see _attempt_request).
# The single-node script, except for an entry its owner holds already: a newer attempt
# takes it over (the older attempt failed, and its late confirmation must then miss
# it; its give-back takes back only its own request's grant, see GIVE_BACK), while a
# stale request leaves it as it is and is refused. Attempts are ordered within one
# process only: an owner reused by another process (a task retried on another
# worker) counts its own, so a late attempt of one process may take over the entry of
# a newer one of the other; its give-back then still leaves that one's grant.
ACQUIRE = (
    _OURS
    + _ATTEMPTS
    + _KINDS
    + _NEXT_TOKEN
    + """
local attempt = ARGV[#ARGV]
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  if not ours(KEYS[1], ARGV[1], attempt) then
    return {0, 0, redis.call('PTTL', KEYS[1])}
  end
  -- What can fail (a key of the wrong type) first, before the first write, the entry
  -- taken over last (see "Half-written" in distlocks.backends.redis.scripts): the
  -- registrations' keys probed, the counter read and checked by keep_fence() before
  -- its own write.
  local waiting = tonumber(ARGV[8]) > 0 or string.sub(ARGV[9], 1, 1) == '1'
  if waiting then kinds(KEYS[3], 'zset', KEYS[4], 'zset') end
  local t = redis.call('TIME')
  local t_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  keep_fence(KEYS[2], t_ms + tonumber(ARGV[2]), t_ms)
  if waiting then
    -- As a fresh grant does: the owner is no longer waiting here.
    redis.call('ZREM', KEYS[3], ARGV[1])
    redis.call('ZREM', KEYS[4], ARGV[1])
  end
  redis.call('HSET', KEYS[1], 'attempt', attempt, 'attempts',
             attempts_with(redis.call('HGET', KEYS[1], 'attempts'), string.sub(ARGV[9], 2)))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token')), tonumber(ARGV[2])}
end
local function single_node()
"""
    + SINGLE_ACQUIRE
    + """
end
local reply = single_node()
if reply[1] == 1 then redis.call('HSET', KEYS[1], 'attempt', attempt) end
return reply
"""
)

# KEYS: lock hash, fence counter. ARGV: owner, token, attempt id.
# Second round of a grant: while this attempt's own entry is still there, raise the
# fencing counter to the grant's token (the largest of the quorum) and record that
# token in the lock hash, so every master of the quorum reports the same one. The
# token may come from a master whose clock is ahead of this one's: keep_fence() keeps
# the counter until this master's clock has passed it too (and the entry has ended).
CONFIRM = (
    _NEXT_TOKEN
    + """
local entry = redis.call('HMGET', KEYS[1], 'owner', 'attempt')
if entry[1] ~= ARGV[1] or entry[2] ~= ARGV[3] then return 0 end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('HSET', KEYS[1], 'token', ARGV[2])
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
keep_fence(KEYS[2], now_ms + math.max(0, redis.call('PTTL', KEYS[1])), now_ms)
return 1
"""
)

# KEYS and ARGV as the single-node release, plus ARGV[3]: an attempt id, and ARGV[4]:
# the attempt's request id: the single-node give-back, which leaves no tombstone.
# The release of what an attempt got and does not count on, which may reach a master
# late (its request was still running, or timed out). By then the lease may have
# renewed the entry, or another attempt of the owner been granted it (this process's
# next one, another process's: see ACQUIRE): those are left (the entry goes once no
# request it was granted by is left).
GIVE_BACK = SINGLE_GIVE_BACK

# KEYS: lock hash, fence counter. ARGV: owner, expiry ms, ttl ms.
# Compare-and-expire, as the single-node script, but the server keeps the lock for
# the ttl plus the drift allowance while the hash records the ttl asked for. The entry
# becomes the lease's: no give-back or request of an attempt can touch it any more,
# so every entry this counts stays the lease's until it is released or expires. The
# counter is kept at least as long as the entry.
EXTEND = (
    _NEXT_TOKEN
    + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
keep_fence(KEYS[2], now_ms + tonumber(ARGV[2]), now_ms)  -- can fail: before the renewal
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[1], 'ttl', ARGV[3], 'attempt', 'lease')
redis.call('HINCRBY', KEYS[1], 'renewals', 1)
return 1
"""
)

# KEYS: lock hashes, then their fence counters in the same order. ARGV: owner, expiry
# ms, ttl ms, for each lock hash in turn.
# EXTEND for the renewer's batch: one call per master; each entry is still
# compare-and-expire on its own. Returns 1 or 0 per key, or -1 for an entry whose own
# keys hold a value of another type (or a counter that is no number): as the
# single-node EXTEND_MANY, such an entry is answered on its own, before anything of it
# is written, where an error would fail the batch after the entries before it were
# renewed.
EXTEND_MANY = (
    _NEXT_TOKEN
    + """
local out = {}
local n = #KEYS / 2
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
local function wrong(reply) return type(reply) == 'table' and reply.err ~= nil end
for i = 1, n do
  local at = 3 * (i - 1)
  local holder = redis.pcall('HGET', KEYS[i], 'owner')
  local fence = holder == ARGV[at + 1] and redis.pcall('GET', KEYS[n + i])
  if wrong(holder) or wrong(fence) or (fence and tonumber(fence) == nil) then
    out[i] = -1
  elseif holder == ARGV[at + 1] then
    keep_fence(KEYS[n + i], now_ms + tonumber(ARGV[at + 2]), now_ms)
    redis.call('PEXPIRE', KEYS[i], ARGV[at + 2])
    redis.call('HSET', KEYS[i], 'ttl', ARGV[at + 3], 'attempt', 'lease')
    redis.call('HINCRBY', KEYS[i], 'renewals', 1)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

_SCRIPTS = {
    "acquire": ACQUIRE,
    "confirm": CONFIRM,
    "give_back": GIVE_BACK,
    "extend": EXTEND,
    "extend_many": EXTEND_MANY,
}
