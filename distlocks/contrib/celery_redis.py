"""One round trip for the lock calls of a single-execution task that go together.

:mod:`distlocks.contrib.celery` takes a run lock and keeps a queue marker, two ordinary
locks. Where it changes both at one moment it used to make one round trip to the lock
server for each. On a Redis backend on one server (not a cluster, whose two keys may
live on two nodes, nor Sentinel) this module sends them together:

* :func:`send_together`: the backend's own lock scripts (acquire, release), pipelined on
  the thread's pinned connection: one round trip, run by the server in the order given.
  Used where the calls need no atomicity between them, only an order (the run lock is
  taken, then the marker let go), and where each is safe to send again (an acquire by
  the same owner, a release whose answer is not needed), so a connection broken in the
  middle falls back to the plain calls.
* :func:`enqueue`: the enqueue-time check of ``unique_while`` as one script, where two
  things must be decided in one server-side step: a run of the same key that holds the
  run lock, or a queued copy that holds the marker, is the task to return; otherwise
  the marker is taken for the new call. The script is the backend's own acquire
  script with that check in front of it, so the marker is taken exactly as
  ``backend.acquire()`` takes a lock.

Both return None where they cannot be used; the caller then makes the plain calls.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from distlocks import signals, transactions
from distlocks.backends.base import AcquireResult, BaseBackend, Holder
from distlocks.exceptions import LockError
from distlocks.lease import FREE_LOST, RELEASE, Lease

try:
    import redis
    from redis.exceptions import NoScriptError

    from distlocks.backends.redis import RedisBackend
    from distlocks.backends.redis.calls import (
        _DRIVER_ERRORS,
        _hiredis_pack,
        _HiredisPacker,
        _text,
    )
    from distlocks.backends.redis.scripts import ACQUIRE
except ImportError:  # pragma: no cover - without redis-py no backend here is a Redis one
    _REDIS = False
    ACQUIRE = ""
else:
    _REDIS = True

# In front of the acquire script. KEYS: as ACQUIRE's, then (with ARGV[10] = '1') the
# run lock's hash, removed from KEYS here so that ACQUIRE sees its own. A holder's
# task id is in its holder details ('extra', JSON), as backend.inspect() reads it.
_CHECK = """
local function task_of(hash)
  local extra = redis.call('HGET', hash, 'extra')
  if not extra then return nil end
  local ok, data = pcall(cjson.decode, extra)
  if not ok or type(data) ~= 'table' then return nil end
  local eager, id = data['celery_eager'], data['celery_task_id']
  if eager and eager ~= cjson.null and eager ~= '' and eager ~= false then return nil end
  if id == nil or id == cjson.null or id == '' or id == false then return nil end
  return tostring(id)
end
if ARGV[10] == '1' then
  local running = task_of(table.remove(KEYS))
  if running then return {2, running} end
end
local marker_owner = redis.call('HGET', KEYS[1], 'owner')
if marker_owner and marker_owner ~= ARGV[1] then
  return {3, task_of(KEYS[1]) or ''}
end
"""


class _Script:
    """A script text and its SHA-1, as the server names it (reloaded when missing)."""

    __slots__ = ("script", "sha")

    def __init__(self, text: str) -> None:
        self.script = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


ENQUEUE = _Script(_CHECK + ACQUIRE)

logger = logging.getLogger("distlocks.contrib.celery")
#: Release steps that send a release to the server.
_SENT = (RELEASE, FREE_LOST)

#: :func:`enqueue`'s answers.
TAKEN, RUNNING, QUEUED = "taken", "running", "queued"


def usable(backend: BaseBackend) -> bool:
    """Whether calls to ``backend`` can be sent together (a Redis backend on one server)."""
    return _REDIS and isinstance(backend, RedisBackend) and backend._direct


def send_together(backend: Any, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any] | None:
    """Run the scripts of ``calls`` (script, keys, args; a script is a name of the
    backend's scripts or a :class:`_Script`) in one round trip, in order: the reply of
    each, or the ``redis.ResponseError`` it met. A connection broken on the way is
    reconnected and the same calls sent once more (each is safe to repeat as it is).
    None where it could not be done (no pinned connection for this thread, or the
    connection broke twice): the caller makes the calls one by one."""
    conn = backend._pinned()
    if conn is None:
        return None
    scripts = [backend._scripts[s] if isinstance(s, str) else s for s, _, _ in calls]
    replies: list[Any] = [None] * len(calls)
    pending = list(range(len(calls)))
    reloaded = reconnected = False
    while True:
        commands = [
            ("EVALSHA", scripts[i].sha, len(calls[i][1]), *calls[i][1], *calls[i][2])
            for i in pending
        ]
        got: list[Any] = []
        try:
            if _hiredis_pack is not None and type(conn._command_packer) is _HiredisPacker:
                # As the backend's own calls do: our arguments are str and int.
                conn.send_packed_command([_hiredis_pack(command) for command in commands])
            else:
                conn.send_packed_command(conn.pack_commands(commands))
            for _ in commands:
                try:
                    got.append(conn.read_response())
                except redis.ResponseError as exc:  # this command's error, the others stand
                    got.append(exc)
        except redis.ConnectionError:
            conn.disconnect()  # reconnects at its next use
            if reconnected:
                return None
            # The server may have run some or all of them, their replies lost. The very
            # same calls are sent again (not the caller's plain calls, which would be new
            # ones): an acquire by the same owner is answered as granted, a release by
            # the same request id as released (its tombstone), so what the server did
            # the first time is what the caller is told.
            reconnected = True
            continue
        except BaseException:
            # A reply may be unread (a timeout): the connection cannot be trusted.
            conn.disconnect()
            raise
        missing = []
        for i, reply in zip(pending, got, strict=True):
            if isinstance(reply, NoScriptError):
                missing.append(i)
            else:
                replies[i] = reply
        if not missing:
            return replies
        if reloaded:
            raise got[pending.index(missing[0])]
        # The server's script cache was emptied (a restart, SCRIPT FLUSH): load the
        # missing scripts and send those calls again, still in their order.
        reloaded = True
        try:
            for i in missing:
                conn.send_command("SCRIPT", "LOAD", scripts[i].script)
                scripts[i].sha = _text(conn.read_response())
        except BaseException:
            conn.disconnect()
            raise
        pending = missing


def acquire_call(
    backend: Any, name: str, owner: str, ttl: float, holder: Holder
) -> tuple[str, list[str], list[Any]]:
    """The acquire script's call for ``name`` (at once, no waiting)."""
    keys, args = backend._indexed_acquire_call(name, owner, ttl, holder, 0.0, False)
    return "acquire", keys, args


def release_call(backend: Any, name: str, owner: str) -> tuple[str, list[str], list[Any]]:
    """The release script's call for ``name``."""
    keys, args = backend._indexed_release_call(name, owner)
    return "release", keys, args


def acquired(backend: Any, name: str, owner: str, reply: Any) -> AcquireResult:
    """An acquire script's reply (or its error) as ``backend.acquire()`` reports it."""
    if isinstance(reply, Exception):
        raise backend._acquire_error(name, owner, reply) from reply
    return backend._acquire_result(reply)


def enqueue(
    backend: Any,
    marker: str,
    owner: str,
    ttl: float,
    holder: Holder,
    run_lock: str | None,
) -> tuple[str, Any] | None:
    """Take the queue ``marker`` for ``owner`` unless the task to return instead is
    found, in one server-side step: ``(RUNNING, task id)`` when ``run_lock`` (given for
    ``"queued_or_running"``) is held by a task run, ``(QUEUED, task id or "")`` when
    another call holds the marker, ``(TAKEN, AcquireResult)`` when it was taken.
    None where the script cannot be used here."""
    keys, args = backend._indexed_acquire_call(marker, owner, ttl, holder, 0.0, False)
    if run_lock is not None:
        keys = [*keys, backend.all_keys(run_lock).lock]
    args = [*args, "1" if run_lock is not None else "0"]
    try:
        replies = send_together(backend, [(ENQUEUE, keys, args)])
    except _DRIVER_ERRORS as exc:
        raise backend._acquire_error(marker, owner, exc) from exc
    if replies is None:
        return None
    reply = replies[0]
    if isinstance(reply, Exception):
        raise backend._acquire_error(marker, owner, reply) from reply
    kind = reply[0]
    if kind == 2:
        return RUNNING, _text(reply[1])
    if kind == 3:
        return QUEUED, _text(reply[1])
    return TAKEN, backend._acquire_result(reply)


def release_both(lease: Lease, marker: Lease) -> bool | None:
    """Release the run lock's ``lease`` and then the queue ``marker`` in one round trip,
    with what :meth:`Lease.release` does for each (a loss found is reported, the
    ``lock_released`` receivers hear of each release): whether the run lock was freed
    by this call, as ``lease.release()`` answers. A failed marker release is logged
    (it runs out by itself). None where it is not done here (a lease held twice, a
    release that waits for a transaction, a forked child): the caller releases them
    one by one."""
    backend: Any = lease._backend
    if (
        lease._inherited()
        or marker._inherited()
        or lease._depth > 1
        or marker._depth > 1
        or lease._deferral is not None
        or marker._deferral is not None
    ):
        return None
    if lease.release_on_commit is not False and transactions.open_transactions():
        return None  # lease.release() decides whether it waits for the transaction
    with lease._mutex, marker._mutex:
        steps = [lease._release_step(), marker._release_step()]
        sent = [(i, item) for i, item in enumerate((lease, marker)) if steps[i] in _SENT]
        calls = [release_call(backend, item.name, item.owner) for _, item in sent]
        try:
            replies = send_together(backend, calls) if calls else []
        except _DRIVER_ERRORS as exc:
            # A timeout (the server may have run them): as lease.release() reports it,
            # and both leases end by expiry if it did not.
            raise backend._error("release", lease.name, exc) from exc
        if replies is None:  # the connection broke twice: the same calls, one by one
            replies = [
                _release_or_error(backend, item.name, call)
                for (_, item), call in zip(sent, calls, strict=True)
            ]
        answers: list[Any] = [None, None]
        for (i, _), reply in zip(sent, replies, strict=True):
            answers[i] = reply
        marker_answer = answers[1]
        if isinstance(marker_answer, Exception):
            logger.warning("Could not release queue marker %r: %s", marker.name, marker_answer)
        elif steps[1] == RELEASE and marker._released(bool(marker_answer)):
            marker._on_finished()
            _released_signal(marker)
        answer = answers[0]
        if steps[0] != RELEASE:
            return False
        if isinstance(answer, Exception):
            if isinstance(answer, LockError):
                raise answer
            raise backend._error("release", lease.name, answer) from answer
        if not lease._released(bool(answer)):
            return False
    lease._on_finished()
    _released_signal(lease)
    return True


def _release_or_error(backend: Any, name: str, call: tuple[str, list[str], list[Any]]) -> Any:
    """The release ``call`` as built (its request id too: a release the server already
    ran is answered by its tombstone), or the error it met."""
    try:
        return backend._run(*call)
    except _DRIVER_ERRORS as exc:
        error = backend._error("release", name, exc)
        error.__cause__ = exc
        return error


def _released_signal(lease: Lease) -> None:
    if signals.lock_released.receivers:
        signals.lock_released.send(sender=Lease, lease=lease)
