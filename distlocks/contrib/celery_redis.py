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
* :func:`publish_with_marker`: where the Celery broker is the same Redis database as
  the lock backend, the same check with the message's publish in it: the message is
  pushed onto its queue by the script that takes the marker, and only if it takes
  it, so an enqueue is one round trip instead of two, and a publish that fails
  leaves no marker (nothing is written at all).

All return None where they cannot be used; the caller then makes the plain calls.

It is one module because the three share what decides whether they can be used at
all (the backend's topology, a server that refused a script naming two slots, the
pinned connection and its resend after a lost reply); split, each part would import
the others' private rules.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from distlocks import signals, transactions
from distlocks.backends.base import AcquireResult, BaseBackend, Holder
from distlocks.contrib.celery_scripts import RUN_START as _RUN_START
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
"""
# The rest of the check, given the marker's owner (``marker_owner``, false when free).
_CHECK_QUEUED = """
if marker_owner and marker_owner ~= ARGV[1] then
  return {3, task_of(KEYS[1]) or ''}
end
"""
_MARKER_OWNER = """
local marker_owner = redis.call('HGET', KEYS[1], 'owner')
"""


class _Script:
    """A script text and its SHA-1, as the server names it (reloaded when missing)."""

    __slots__ = ("script", "sha")

    def __init__(self, text: str) -> None:
        self.script = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


ENQUEUE = _Script(_CHECK + _MARKER_OWNER + _CHECK_QUEUED + ACQUIRE)

# The enqueue check with the publish folded in. KEYS: as ENQUEUE's, then the tombstone
# below, then one key per broker command; ARGV: as ENQUEUE's, then ARGV[11] = the
# number n of broker commands, then each command's name and value (ARGV[10 + 2i],
# ARGV[11 + 2i] for its key KEYS[..]).
# The commands are those kombu's Redis transport makes to publish the message (an LPUSH
# onto the queue, then a PEXPIRE per priority queue where the queue expires). They are
# taken off KEYS and ARGV first, so the check and ACQUIRE see theirs as ENQUEUE does.
# The push comes before the marker is written: a push the server refuses (the queue key
# of another type, an ACL) fails the call with nothing written ({5, error}), and the
# caller publishes the plain way. A marker already held by the very owner of this call
# can only be this call's own first run whose reply was lost (its task id is new): the
# message went with it, and is not pushed twice ({4}).
#
# That first run may also be seen by its tombstone, the key KEYS[sent] (before the
# broker's keys; ``<marker's base>:sent:<owner>``, kept SENT_GRACE_MS), written with the
# push: by the time the call is sent again, the task may have started on a worker,
# which lets the marker go ("queued") or takes it over ("queued_or_running"); without
# the tombstone the call would then push the message again, or be answered with its
# own task's id as another's.
SENT_GRACE_MS = 60_000
_FOLD_HEAD = (
    """
local sends = {}
for i = tonumber(ARGV[11]), 1, -1 do
  sends[i] = {ARGV[10 + 2 * i], table.remove(KEYS), ARGV[11 + 2 * i]}
end
local sent_key = table.remove(KEYS)
if redis.call('EXISTS', sent_key) == 1 then return {4} end
"""
    + _MARKER_OWNER
    + """
if marker_owner == ARGV[1] then return {4} end
"""
)
_FOLD_PUSH = """
for i = 1, #sends do
  local sent = redis.pcall(sends[i][1], sends[i][2], sends[i][3])
  if i == 1 and type(sent) == 'table' and sent.err then return {5, sent.err} end
end
redis.call('SET', sent_key, '1', 'PX', SENT_GRACE_MS)
""".replace("SENT_GRACE_MS", str(SENT_GRACE_MS))
# A script is not undone when it fails half-way: ACQUIRE failing after the push (one of
# the keys it writes holds another type: its fencing counter, the listing index) would
# leave the message queued with no marker, and the caller told it failed; a caller that
# tries again queues the task twice. So ACQUIRE runs under pcall, and if it fails the
# message pushed is taken back off its queue (LREM: each message is unique, it carries
# its delivery tag) with what ACQUIRE wrote of the marker (no marker of this owner was
# there before: the head returned {4} for one), and the error is the script's answer.
_FOLD_ACQUIRE = (
    """
local acquired, reply = pcall(function()
"""
    + ACQUIRE
    + """
end)
if acquired then return reply end
redis.call('LREM', sends[1][2], 1, sends[1][3])
redis.call('DEL', sent_key)
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[5] then redis.pcall('HDEL', KEYS[5], ARGV[3]) end
end
if type(reply) == 'table' and reply.err then reply = reply.err end
return redis.error_reply(tostring(reply))
"""
)
# The marker's owner is read once, by the head, for the check too (the script writes
# nothing in between).
FOLD = _Script(_FOLD_HEAD + _CHECK + _CHECK_QUEUED + _FOLD_PUSH + _FOLD_ACQUIRE)
RUN_START = _Script(_RUN_START)

logger = logging.getLogger("distlocks.contrib.celery")
#: Release steps that send a release to the server.
_SENT = (RELEASE, FREE_LOST)

#: :func:`enqueue`'s answers, and :func:`publish_with_marker`'s (SENT: published).
TAKEN, RUNNING, QUEUED, SENT = "taken", "running", "queued", "sent"


def usable(backend: BaseBackend) -> bool:
    """Whether calls to ``backend`` can be sent together (a Redis backend on one server)."""
    return _REDIS and isinstance(backend, RedisBackend) and backend._direct


# Backends whose server refused a script that names keys of two slots: a Redis Cluster
# node named as one server (redis://), which serves every slot but refuses such a call
# before running any of it. The run lock's keys and its marker's are in two slots (each
# lock's keys share a hash tag of its own name), so the scripts that name both (the run
# start's, the enqueue check of "queued_or_running", a folded publish's with the
# broker's keys) are not sent there again: the caller makes the plain calls, each of
# one lock's keys.
_ONE_SLOT_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def two_slots(backend: BaseBackend) -> bool:
    """Whether a script naming keys of two slots may be sent to ``backend`` (its server
    has not refused one)."""
    return backend not in _ONE_SLOT_ONLY


def refused_two_slots(backend: BaseBackend, reply: Any) -> bool:
    """Whether ``reply`` is the server's refusal of a script whose keys are in two slots
    (it ran none of it); if so, ``backend`` is noted as refusing them."""
    if not (_REDIS and isinstance(reply, redis.exceptions.ClusterCrossSlotError)):
        return False
    if backend not in _ONE_SLOT_ONLY:
        _ONE_SLOT_ONLY.add(backend)
        logger.info(
            "Backend %r refuses a script naming keys of two slots (a Redis Cluster node "
            "named as one server): its Celery calls are made one by one",
            getattr(backend, "alias", "?"),
        )
    return True


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
                # As the backend's own calls do: our arguments are str and int. Joined:
                # redis-py writes each piece of a list on its own, and the server may
                # then wake for the first, answer it, and wake again for the second.
                conn.send_packed_command([b"".join(map(_hiredis_pack, commands))])
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


def run_start_call(
    backend: Any, name: str, owner: str, ttl: float, holder: Holder, marker: str, marker_owner: str
) -> tuple[_Script, list[str], list[Any]]:
    """The call that lets the queue ``marker`` of ``marker_owner`` go and takes the run
    lock ``name`` at once, in one script (see ``celery_scripts.RUN_START``); its reply
    is the acquire script's, with the marker's error ('' when none) after it."""
    keys, args = backend._indexed_acquire_call(name, owner, ttl, holder, 0.0, False)
    k = backend.all_keys(marker)
    keys = [*keys, k.lock, k.waiters, k.queue, k.signal, k.fence]
    return RUN_START, keys, [*args, marker_owner, marker, k.wake_prefix]


def run_started(reply: list[Any]) -> tuple[list[Any], str]:
    """A run start's reply: the acquire script's, and the marker's error ('' if none)."""
    return reply[:3], _text(reply[3])


def release_call(backend: Any, name: str, owner: str) -> tuple[str, list[str], list[Any]]:
    """The release script's call for ``name``."""
    keys, args = backend._indexed_release_call(name, owner)
    return "release", keys, args


def acquired(backend: Any, name: str, owner: str, reply: Any, args: list[Any]) -> AcquireResult:
    """An acquire script's reply (or its error) as ``backend.acquire()`` reports it.
    ``args``: the call's arguments, whose request id scopes the give-back of a reply
    that did not come to that very request (the owner, a task id, is reused)."""
    if isinstance(reply, Exception):
        raise acquire_error(backend, name, owner, reply, args) from reply
    return backend._acquire_result(reply)


def acquire_error(backend: Any, name: str, owner: str, exc: Exception, args: list[Any]) -> Any:
    """``backend._acquire_error`` with the give-back of the request sent with ``args``
    (the acquire script's nine first), not a release by owner."""
    return backend._acquire_error(name, owner, exc, backend._acquire_undo(name, owner, args))


def enqueue(
    backend: Any,
    marker: str,
    owner: str,
    ttl: float,
    holder: Holder,
    run_lock: str | None,
    sends: list[tuple[str, str, Any]] | None = None,
) -> tuple[str, Any] | None:
    """Take the queue ``marker`` for ``owner`` unless the task to return instead is
    found, in one server-side step: ``(RUNNING, task id)`` when ``run_lock`` (given for
    ``"queued_or_running"``) is held by a task run, ``(QUEUED, task id or "")`` when
    another call holds the marker, ``(TAKEN, AcquireResult)`` when it was taken.
    With ``sends`` (a broker's commands: name, key, value), they are run too when the
    marker is taken, and None is the answer if the server refused the first (with
    nothing written). None where the script cannot be used here."""
    if (run_lock is not None or sends is not None) and not two_slots(backend):
        return None  # nothing sent: the plain calls
    keys, args = backend._indexed_acquire_call(marker, owner, ttl, holder, 0.0, False)
    if run_lock is not None:
        keys = [*keys, backend.all_keys(run_lock).lock]
    args = [*args, "1" if run_lock is not None else "0"]
    script = ENQUEUE
    if sends is not None:
        if backend._pinned() is None:
            return None  # nothing sent: the plain calls
        script = FOLD
        lock_key = backend.all_keys(marker).lock
        keys.append(f"{lock_key.removesuffix(':lock')}:sent:{owner}")
        args.append(len(sends))
        for name, key, value in sends:
            keys.append(key)
            args += [name, value]
    try:
        replies = send_together(backend, [(script, keys, args)])
    except _DRIVER_ERRORS as exc:
        if sends is not None:
            # A timeout leaves it in doubt whether the script ran: if it did, the
            # message is queued, and its marker must stay to keep duplicates away
            # (a plain acquire's timeout gives the lock back in the background).
            raise backend._error("acquire", marker, exc) from exc
        raise acquire_error(backend, marker, owner, exc, args) from exc
    if replies is None:
        if sends is not None:
            # The connection broke twice after the call was sent: the script may have
            # run, the message with it. Not the plain calls, which would publish it
            # again under the marker this call may hold: the caller hears of it.
            broke = redis.ConnectionError("the connection broke twice; the script may have run")
            raise backend._error("acquire", marker, broke)
        return None
    reply = replies[0]
    if refused_two_slots(backend, reply):
        return None  # nothing ran: the plain calls
    if isinstance(reply, Exception):
        raise acquire_error(backend, marker, owner, reply, args) from reply
    kind = reply[0]
    if kind == 2:
        return RUNNING, _text(reply[1])
    if kind == 3:
        return QUEUED, _text(reply[1])
    if kind == 4:  # this call's own first run, whose reply was lost: it did it all
        return TAKEN, AcquireResult(True, 0, ttl)
    if kind == 5:
        logger.info("Publishing with queue marker %r refused: %s", marker, _text(reply[1]))
        return None
    return TAKEN, backend._acquire_result(reply)


class NotFolded(Exception):
    """The publish could not go with the marker, and nothing was written: the caller
    publishes the plain way."""


class _Answer(Exception):
    """The marker's answer, another task to return: ``kind`` (RUNNING or QUEUED) and
    its id ("" when the marker is held by no task). Raised through kombu and Celery,
    which have not sent anything, back to :func:`publish_with_marker`."""

    def __init__(self, kind: str, task_id: str) -> None:
        super().__init__(kind, task_id)
        self.kind, self.task_id = kind, task_id


class _Noted:
    """Stands in for kombu's Redis publish batch (``_publish_batch``): notes the
    commands that publishing a message makes, and sends nothing."""

    __slots__ = ("commands",)

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, args))


class _Fold:
    """Put where kombu 5.7's ``Producer`` looks for its active publish batch, for one
    ``apply_async()``: the message that Celery publishes through the producer is
    routed by kombu as usual, and its commands go into the marker's script."""

    def __init__(self, enqueue_call: Callable[..., tuple[str, Any] | None]) -> None:
        #: :func:`enqueue` with all but the broker's commands given (a partial).
        self.enqueue = enqueue_call
        self.done = False

    def publish(self, channel: Any, message: Any, **kwargs: Any) -> Any:
        if self.done:
            # Another message Celery sends through the same producer once the task's
            # is queued (the task-sent event, with task_send_sent_event): sent as
            # kombu sends it without a batch. (A publish of the task's own message
            # again, kombu's retry after a connection error, is not done: it folds
            # again, and the script's head sees the marker is its own.)
            return channel.basic_publish(message, **kwargs)
        noted = _Noted()
        channel.basic_publish(message, _publish_batch=noted, **kwargs)
        sends = _sends(channel, noted.commands)
        if sends is None:
            raise NotFolded
        outcome = self.enqueue(sends=sends)
        if outcome is None:
            raise NotFolded
        kind, found = outcome
        if kind != TAKEN:
            raise _Answer(kind, found)
        self.done = True
        return None


def _sends(channel: Any, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any] | None:
    """kombu's commands for one message as (name, key with the broker's key prefix,
    value), or None where they are not the queue's push (and expiry) we know."""
    if not commands or commands[0][0] != "lpush":
        return None
    prefix = getattr(channel, "global_keyprefix", "") or ""
    sends = []
    for i, (name, args) in enumerate(commands):
        if (i == 0) != (name == "lpush") or name not in ("lpush", "pexpire") or len(args) != 2:
            return None
        key, value = args
        if not isinstance(value, str | int) or isinstance(value, bool):
            return None
        sends.append((name, f"{prefix}{key}", value))
    return sends


def _same_database(channel: Any, backend: Any) -> bool:
    """Whether kombu's Redis ``channel`` and the lock ``backend`` talk to the same
    server and database (as configured: two names for one host do not count)."""
    try:
        theirs = channel.pool.connection_kwargs
    except AttributeError:
        return False
    ours = backend.client.connection_pool.connection_kwargs
    return all(ours.get(k) == theirs.get(k) for k in ("host", "port", "path")) and int(
        ours.get("db") or 0
    ) == int(theirs.get("db") or 0)


def _kombu_folds() -> bool:
    """Whether this kombu is one whose private publish-batch slot the fold was written
    and tested against (5.7.x): another release takes the plain path, whatever it has."""
    try:
        import kombu
    except ImportError:  # pragma: no cover - Celery always brings kombu
        return False
    return tuple(kombu.VERSION[:2]) == (5, 7)


_KOMBU_FOLDS = _kombu_folds()


def publish_with_marker(
    app: Any,
    backend: Any,
    marker: str,
    owner: str,
    ttl: float,
    holder: Holder,
    run_lock: str | None,
    publish: Callable[[Any], Any],
) -> tuple[str, Any] | None:
    """Take the queue ``marker`` and publish the message in one round trip, where
    the broker is the lock backend's Redis database: ``publish(producer)`` is
    Celery's ``apply_async()`` with that producer. ``(SENT, its result)`` when the
    marker was taken and the message pushed, ``(RUNNING, task id)`` or ``(QUEUED, task
    id or "")`` when another task holds the key (nothing was published). None where
    it cannot be done, with nothing written (another broker or database, a kombu
    without publish batches, a message routed other than onto one queue, a push the
    server refused): the caller makes the plain calls."""
    with app.producer_or_acquire() as producer:
        local = getattr(producer, "_batch_local", None)
        channel = producer.channel
        if (
            not _KOMBU_FOLDS
            or not isinstance(local, threading.local)
            or getattr(local, "current", None) is not None  # a batch of the caller's
            or not hasattr(channel, "create_publish_batch")  # kombu before 5.7, not Redis
            or not _same_database(channel, backend)
        ):
            return None
        local.current = _Fold(partial(enqueue, backend, marker, owner, ttl, holder, run_lock))
        try:
            return SENT, publish(producer)
        except NotFolded:
            return None
        except _Answer as answer:
            return answer.kind, answer.task_id
        finally:
            local.current = None


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
    with _when_free(lease, marker) as free:
        if not free:
            # A renewal's (or an extension's) call in flight holds a mutex, perhaps stuck
            # until its socket timeout: the caller's lease.release() goes beside it.
            return None
        steps = [lease._release_step(), marker._release_step()]
        sent = [(i, item) for i, item in enumerate((lease, marker)) if steps[i] in _SENT]
        calls = [release_call(backend, item.name, item.owner) for _, item in sent]
        try:
            replies = send_together(backend, calls) if calls else []
            if replies is None:  # the connection broke twice: the same calls, one by one
                replies = [
                    _release_or_error(backend, item.name, call)
                    for (_, item), call in zip(sent, calls, strict=True)
                ]
        except BaseException as exc:
            for i, item in sent:
                if steps[i] == RELEASE:
                    item._release_failed()  # left to a retry, as lease.release() does
            if isinstance(exc, _DRIVER_ERRORS):
                # A timeout (the server may have run them): as lease.release() reports
                # it, and both leases end by expiry if it did not.
                raise backend._error("release", lease.name, exc) from exc
            raise
        answers: list[Any] = [None, None]
        for (i, _), reply in zip(sent, replies, strict=True):
            answers[i] = reply
        marker_answer = answers[1]
        if isinstance(marker_answer, Exception):
            marker._release_failed()
            logger.warning("Could not release queue marker %r: %s", marker.name, marker_answer)
        elif steps[1] == RELEASE and marker._released(bool(marker_answer)):
            marker._on_finished()
            _released_signal(marker)
        answer = answers[0]
        if steps[0] != RELEASE:
            return False
        if isinstance(answer, Exception):
            lease._release_failed()
            if isinstance(answer, LockError):
                raise answer
            raise backend._error("release", lease.name, answer) from answer
        if not lease._released(bool(answer)):
            return False
    lease._on_finished()
    _released_signal(lease)
    return True


@contextmanager
def _when_free(*leases: Lease) -> Iterator[bool]:
    """Takes the mutexes of ``leases`` without waiting: True when it holds them all,
    False (holding none) when one is busy."""
    taken: list[Any] = []
    try:
        for item in leases:
            if not item._mutex.acquire(False):
                break
            taken.append(item._mutex)
        yield len(taken) == len(leases)
    finally:
        for mutex in reversed(taken):
            mutex.release()


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
