"""A key of the wrong type never leaves a lock operation half-written.

Something other than distlocks (a script, a person, a bug) writes a string where the
backend keeps its listing index, a hash where it keeps a fencing counter, a list where
it keeps a permits set... A Lua script that wrote the lock and then met that key failed
after its write: the caller was told the acquire failed while the lock was held, by an
owner nobody knew (held by nobody until its ttl).

Every script now runs each command that can fail before the write that decides its
outcome (the grant, the release, the renewal, the eviction): a failure changes nothing
the caller is told about. The property, for every operation and every key it touches,
with a value of every other type there: either the operation succeeds, or it raises a
LockError that names the key and says to delete it, and the lock (or permit) is then
exactly as it was before.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from django.test import override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend
from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.clients import _undo_command
from distlocks.exceptions import LockError

pytestmark = pytest.mark.django_db(transaction=False)

HOLDER = Holder(host="test", pid=1, thread="t", extra={})
TYPES = ("string", "hash", "list", "set", "zset")


def _write(client: redis.Redis, key: str, kind: str) -> None:
    """A value of type ``kind`` at ``key`` (written by someone else)."""
    client.delete(key)
    if kind == "string":
        client.set(key, "not distlocks'")
    elif kind == "hash":
        client.hset(key, "someone", "else")
    elif kind == "list":
        client.rpush(key, "someone")
    elif kind == "set":
        client.sadd(key, "someone")
    else:
        client.zadd(key, {"someone": 1})


@contextlib.contextmanager
def own_prefix(
    settings: Any, prefix: str, location: str | None = None, **options: Any
) -> Iterator[RedisBackend]:
    """A backend on the session's server (or ``location``) under a key prefix (and
    alias) of its own, ``prefix`` and a random suffix: every key under it, the listing
    index's too, is the caller's alone."""
    alias = f"{prefix}-{uuid.uuid4().hex[:8]}"
    config = {"BACKEND": "distlocks.backends.redis.RedisBackend",
              "LOCATION": location or settings.REDIS_URL,
              "OPTIONS": {"key_prefix": alias, **options}}  # fmt: skip
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, alias: config}):
        found = get_backend(alias)
        assert isinstance(found, RedisBackend)
        try:
            yield found
        finally:
            found.close()


@pytest.fixture
def backend(settings: Any) -> Iterator[RedisBackend]:
    """A key prefix of its own: its listing index is this test's alone."""
    with own_prefix(settings, "half") as found:
        yield found


# -- what each operation is, where its keys are, and what "as it was" means --------


@dataclass
class Case:
    """One operation on a name, set up by ``before``; ``state`` reads what the caller
    is told about (who holds it, until when), ``ok`` checks a success."""

    op: str
    family: str  # "lock", SEMAPHORE, READ or WRITE
    roles: tuple[str, ...]  # the keys it touches that another type can be written at


LOCK_ROLES = ("fence", "waiters", "queue", "signal", "index")
SEM_ROLES = ("info", "waiters", "signal", "permits")
RW_ROLES = ("info", "writer", "wwait", "rwait", "wsig", "rsig", "fence", "permits")
CASES = [
    *(Case(op, "lock", LOCK_ROLES) for op in
      ("acquire", "acquire_fair", "acquire_again", "release", "extend", "keep", "extend_many",
       "force_release", "give_back", "give_back_kept")),
    *(Case(op, SEMAPHORE, SEM_ROLES) for op in
      ("acquire", "acquire_again", "release", "extend", "force_release", "give_back",
       "give_back_kept")),
    *(Case(op, kind, RW_ROLES) for kind in (READ, WRITE) for op in
      ("acquire", "acquire_again", "release", "extend", "force_release", "give_back",
       "give_back_kept")),
]  # fmt: skip


def _granted_undo(backend: RedisBackend, family: str, name: str) -> Any:
    """Acquire ``name`` for "me" by one request of its own; return its give-back."""
    if family == "lock":
        keys, args = backend._indexed_acquire_call(name, "me", 30, HOLDER, 0.0, False)
        assert backend._run("acquire", keys, args)[0] == 1
        return backend._acquire_undo(name, "me", args)
    script, keys, args, undo = backend._permit_acquire_call(family, name, "me", 30, HOLDER, 1, 0)
    assert script(backend.client, keys, args)[0] == 1
    return undo


def _give_back(backend: RedisBackend, name: str, undo: Any) -> None:
    """Run the give-back ``undo``, as the background give-back does."""
    with backend._errors("give back", name):
        backend.client.execute_command(*_undo_command(undo))


def _key(backend: RedisBackend, name: str, family: str, role: str) -> str:
    if role == "index":
        return backend.index_key
    if role == "permits":
        return backend.index_permits_key
    if family == "lock":
        return str(getattr(backend.all_keys(name), role))
    base = backend.all_keys(name).lock.removesuffix(":lock")
    return f"{base}:{'sem' if family == SEMAPHORE else 'rw'}:{role}"


def _state(backend: RedisBackend, client: redis.Redis, name: str, family: str) -> Any:
    """What a caller is told about: who holds it, and until when (a lock's pttl in ms;
    the end of each permit, as stored)."""
    if family == "lock":
        keys = backend.all_keys(name)
        owner = client.hget(keys.lock, "owner")
        return owner, client.pttl(keys.lock) if owner else None
    base = backend.all_keys(name).lock.removesuffix(":lock")
    holders = f"{base}:sem" if family == SEMAPHORE else f"{base}:rw"
    return client.zrange(holders, 0, -1, withscores=True)


def _same(before: Any, after: Any, family: str) -> bool:
    if family != "lock" or before[1] is None or after[1] is None:
        return bool(before == after)
    # The same owner, and no renewal: the calls under test ask for 300 s, from 30 s.
    return bool(before[0] == after[0] and abs(before[1] - after[1]) < 60_000)


def _run(backend: RedisBackend, case: Case, name: str) -> Callable[[], Any]:
    """Set up ``case`` on ``name`` (with a waiter registered, so that releases wake
    someone), and return the call under test."""
    family, op = case.family, case.op
    if family == "lock":
        if op in ("acquire", "acquire_fair"):
            fair = op == "acquire_fair"
            if fair:  # a waiter queued, then the lock freed: the fair path's reads
                backend.acquire(name, "first", 30, HOLDER)
                backend.acquire(name, "waiter", 30, HOLDER, wait=5, fair=True)
                backend.release(name, "first")
                return lambda: backend.acquire(name, "waiter", 30, HOLDER, wait=5, fair=True)
            return lambda: backend.acquire(name, "me", 30, HOLDER)
        if op in ("give_back", "give_back_kept"):
            # Granted by one request, or by two (its give-back leaves it held).
            undo = _granted_undo(backend, family, name)
            if op == "give_back_kept":
                _granted_undo(backend, family, name)
            backend.acquire(name, "waiter", 30, HOLDER, wait=5)  # refused: registered
            return lambda: _give_back(backend, name, undo)
        assert backend.acquire(name, "me", 30, HOLDER).acquired
        backend.acquire(name, "waiter", 30, HOLDER, wait=5)  # refused: registered
        return {
            "acquire_again": lambda: backend.acquire(name, "me", 300, HOLDER),
            "release": lambda: backend.release(name, "me"),
            "extend": lambda: backend.extend(name, "me", 300),
            "keep": lambda: backend.keep(name, "me", 300),
            "extend_many": lambda: backend.extend_many([(name, "me", 300)]),
            "force_release": lambda: backend.force_release(name),
        }[op]
    kind = family
    if op == "acquire":
        return lambda: backend.permit_acquire(kind, name, "me", 30, HOLDER, limit=1)
    undo = _granted_undo(backend, kind, name)
    if op == "give_back_kept":
        _granted_undo(backend, kind, name)
    other = READ if kind == WRITE else WRITE
    if kind != SEMAPHORE:  # a waiter of the other kind registered
        backend.permit_acquire(other, name, "waiter", 30, HOLDER, wait=5)
    else:
        backend.permit_acquire(kind, name, "waiter", 30, HOLDER, limit=1, wait=5)
    return {
        "acquire_again": lambda: backend.permit_acquire(kind, name, "me", 300, HOLDER, limit=1),
        "release": lambda: backend.permit_release(kind, name, "me"),
        "extend": lambda: backend.permit_extend(kind, name, "me", 300),
        "force_release": lambda: backend.permit_force_release(kind, name, "me"),
        "give_back": lambda: _give_back(backend, name, undo),
        "give_back_kept": lambda: _give_back(backend, name, undo),
    }[op]


@hsettings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_key_of_the_wrong_type_changes_nothing_the_caller_is_told_about(
    backend: RedisBackend, redis_client: redis.Redis, data: st.DataObject
) -> None:
    case = data.draw(st.sampled_from(CASES), label="case")
    role = data.draw(st.sampled_from(case.roles), label="role")
    name = f"half:{uuid.uuid4().hex[:10]}"
    call = _run(backend, case, name)
    key = _key(backend, name, case.family, role)
    have = redis_client.type(key).decode()
    kind = data.draw(st.sampled_from([t for t in TYPES if t != have]), label="type")
    _write(redis_client, key, kind)
    before = _state(backend, redis_client, name, case.family)
    try:
        try:
            call()
        except LockError as exc:
            message = str(exc)
            after = _state(backend, redis_client, name, case.family)
            assert _same(before, after, case.family), (
                f"{case.family} {case.op} failed on its {role} key (a {kind}) after "
                f"changing what it reports: {before} -> {after}"
            )
            assert key in message and "delete" in message.lower(), message
    finally:
        redis_client.delete(key)
        for owner in ("me", "waiter", "first"):
            if case.family == "lock":
                backend.release(name, owner)
            else:
                backend.permit_force_release(case.family, name, None)
