"""Lua scripts of the Celery run path on a Redis server (text only, no I/O), used by
:mod:`distlocks.contrib.celery_redis`.

On a loaded machine a script's cost on the server is mostly the script itself, not the
commands in it: each call the server runs is parsed, looked up, run in Lua and
answered, and while it runs the client that sent it waits. So where the run path sent
two of the backend's scripts together, one script here does the work of both, built
from the backend's own so that the lock is taken exactly as ``backend.acquire()``
takes it (fencing token, holder record, listing index, expiry bookkeeping).
"""

from __future__ import annotations

try:
    from distlocks.backends.redis.scripts import _NEXT_TOKEN, _WAKE, ACQUIRE
except ImportError:  # pragma: no cover - without redis-py no backend here is a Redis one
    _NEXT_TOKEN = _WAKE = ACQUIRE = ""

# The start of a run with unique_while="queued": the queue marker let go, then the run
# lock taken at once by the backend's ACQUIRE, in one server-side step (so in no order
# anyone can see: the key is covered throughout). It was two scripts in one round trip.
#
# KEYS: ACQUIRE's (run lock hash, fence counter, waiters, queue[, listing index]), then
# the marker's hash, waiters, queue, signal and fence counter.
# ARGV: ACQUIRE's nine, then the marker's owner, its name (the index field) and its wake
# key prefix. The marker's keys and arguments are taken off the ends first, so that
# ACQUIRE sees its own as backend.acquire() sends them.
#
# The marker is released as RELEASE does it (compare-and-delete, the counter kept only
# past the clock and the grace, the index entry dropped, a waiter woken), except for
# the tombstone: nobody reads this release's answer, and sent again after a lost reply
# it finds the marker gone and changes nothing. It runs under pcall: a marker that
# cannot be released (a key of another type) runs out by itself, and must not keep the
# run from its lock; its error comes back as the reply's fourth item ('' when none).
# Returns ACQUIRE's reply, then that item.
RUN_START = (
    _WAKE
    + _NEXT_TOKEN
    + """
local marker_fence = table.remove(KEYS)
local marker_signal = table.remove(KEYS)
local marker_queue = table.remove(KEYS)
local marker_waiters = table.remove(KEYS)
local marker = table.remove(KEYS)
local marker_wake = table.remove(ARGV)
local marker_name = table.remove(ARGV)
local marker_owner = table.remove(ARGV)
local marker_ok, marker_error = pcall(function()
  if redis.call('HGET', marker, 'owner') ~= marker_owner then return end
  local clock = redis.call('TIME')
  local clock_ms = clock[1] * 1000 + math.floor(clock[2] / 1000)
  -- In RELEASE's order: what can fail (a counter of another type) before any write.
  keep_fence(marker_fence, 0, clock_ms)
  if redis.call('EXISTS', marker_waiters) == 1 then
    wake(marker_waiters, marker_queue, marker_signal, marker_wake, clock_ms)
  end
  if KEYS[5] then redis.call('HDEL', KEYS[5], marker_name) end
  redis.call('DEL', marker)
end)
local reply = (function()
"""
    + ACQUIRE
    + """
end)()
if marker_ok then
  reply[4] = ''
else
  if type(marker_error) == 'table' and marker_error.err then marker_error = marker_error.err end
  reply[4] = tostring(marker_error)
end
return reply
"""
)
