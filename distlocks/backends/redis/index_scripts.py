"""The listing index's sweep, a Lua fragment of the grants (text only, no I/O): what
keeps the index of :mod:`.scripts` from holding an entry per lease ever taken.
"""

from __future__ import annotations

# The listing index's sweep: about one grant in INDEX_SWEEP_EVERY (those whose fencing
# token is a multiple of it: tokens follow the server clock in microseconds, so which
# grants sweep is as good as random, and costs no counter) reads the next
# INDEX_SWEEP_COUNT or so entries of the index (HSCAN, from the cursor kept in the string
# ``<index>:sweep``) and drops those whose expiry (the entry's seventh field) is more than
# INDEX_PRUNE_AFTER_MS past, so that a server whose leases expire unreleased and are never
# listed does not keep an entry per lease ever taken. A full pass over N entries takes
# about N * EVERY / COUNT grants and drops every entry that had expired when the pass
# reached it; the entries of leases that expired since are dropped by the next pass. With
# COUNT twice EVERY, a grant adds one entry while the sweep reads two on average: the
# index holds at most about twice the leases live during the last two passes, plus those
# that expired within the margin. The cost is a few microseconds in one grant out of EVERY,
# where an expiry sorted set cost a ZADD and a range read per grant and a ZREM per release.
# The lock's own key ends at the entry's expiry, give or take the time a script runs (the
# same script set both, from the same clock): the margin makes sure it is gone, so the
# entry dropped is one a listing would drop too. An entry without an expiry ('' for a lock
# without one, or a whole entry '' for a lock whose fields hold a NUL) and the index's
# epoch field are left to the listing, which checks each against its lock.
INDEX_SWEEP_EVERY = 8
INDEX_SWEEP_COUNT = 16
INDEX_PRUNE_AFTER_MS = 1000
# One step of a sweep (the lock index's hash here, the permits set in .permit_scripts):
# ``scan`` (HSCAN or SSCAN) reads the next INDEX_SWEEP_COUNT or so entries of ``index``
# from the cursor kept in the string '<index>:sweep', ``gone`` picks those to drop from
# what it read, ``remove`` (HDEL or SREM) drops them. A sweep runs after the grant is
# written: an error there would fail a script whose lock stays held, by an owner whose
# caller was told it failed. So its reads are pcall()s, and a cursor that is not one
# (lost, rewritten, of another type) starts the pass again instead.
_SWEEP = """
local function sweep_step(index, scan, remove, gone)
  local state = index .. ':sweep'
  local cursor = redis.pcall('GET', state)
  if type(cursor) ~= 'string' or #cursor > 19 or not string.match(cursor, '^%d+$') then
    cursor = '0'
  end
  local found = redis.pcall(scan, index, cursor, 'COUNT', INDEX_SWEEP_COUNT)
  if found.err then
    redis.pcall('SET', state, '0')
    return
  end
  local drop = gone(found[2])
  if #drop > 0 then redis.call(remove, index, unpack(drop)) end
  redis.call('SET', state, found[1])
end
""".replace("INDEX_SWEEP_COUNT", str(INDEX_SWEEP_COUNT))

_INDEX_SWEEP = (
    _SWEEP
    + """
local function entry_expiry(value)
  local at = 0
  for _ = 1, 6 do
    at = string.find(value, '\\0', at + 1, true)
    if not at then return nil end
  end
  local stop = string.find(value, '\\0', at + 1, true)
  if not stop then return nil end
  return tonumber(string.sub(value, at + 1, stop - 1))
end
local function index_sweep(index, now_ms, token)
  if token % INDEX_SWEEP_EVERY ~= 0 then return end
  local before = now_ms - INDEX_PRUNE_AFTER_MS
  sweep_step(index, 'HSCAN', 'HDEL', function(fields)
    local gone = {}
    for i = 1, #fields, 2 do
      local expires = entry_expiry(fields[i + 1])
      if expires and expires < before then gone[#gone + 1] = fields[i] end
    end
    return gone
  end)
end
""".replace("INDEX_PRUNE_AFTER_MS", str(INDEX_PRUNE_AFTER_MS)).replace(
        "INDEX_SWEEP_EVERY", str(INDEX_SWEEP_EVERY)
    )
)
