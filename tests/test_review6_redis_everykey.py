"""A key of the wrong type leaves every other key of the operation as it was.

tests/test_redis_halfwritten.py checks what the caller is told about (the holder and
its expiry). This checks every key the backend keeps for the name and the listing
index, byte for byte (DUMP), including the keys the permits keep their holders in.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from distlocks.backends.base import READ, SEMAPHORE, WRITE
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockError
from tests.test_redis_halfwritten import CASES, TYPES, _key, _run, _write, own_prefix

pytestmark = pytest.mark.django_db(transaction=False)


@pytest.fixture
def backend(settings: Any) -> Iterator[RedisBackend]:
    """A key prefix of its own: every key under it is this test's."""
    with own_prefix(settings, "every") as found:
        yield found


def _snapshot(client: redis.Redis, backend: RedisBackend, skip: str) -> dict[bytes, Any]:
    prefix = backend.key_prefix
    keys = set(client.scan_iter(match=f"{prefix}:*", count=1000))
    return {k: client.dump(k) for k in sorted(keys) if k != skip.encode()}


# What a failed call may still have written, on the hot paths only (a lock cycle has a
# command budget, tests/test_redis_cycle_work.py, that type probes would break): none
# of it is something a caller is told about. A fencing counter moved on (a token never
# issued: tokens stay strictly increasing), the caller's own wait registration dropped
# (its acquire loop drops it on an error anyway), a waiter woken for nothing (it finds
# the lock held and waits again), a permit name in the listing's permits set (swept when
# it has no permit). Releases wake first, then give the permit back: the holder's
# details, its listing and the permit go together or not at all.
HARMLESS = {
    ("lock", "acquire"): ("fence", "waiters", "queue"),
    ("lock", "acquire_fair"): ("fence", "waiters", "queue"),
    ("lock", "release"): ("signal",),
    ("lock", "give_back"): ("signal",),
    **{(kind, "acquire"): ("permits", "fence") for kind in (SEMAPHORE, READ, WRITE)},
    (SEMAPHORE, "release"): ("signal",),
    (READ, "release"): ("wsig", "rsig"),
    (WRITE, "release"): ("wsig", "rsig"),
    (SEMAPHORE, "give_back"): ("signal",),
    (READ, "give_back"): ("wsig", "rsig"),
    (WRITE, "give_back"): ("wsig", "rsig"),
}


# Every operation, every key it touches, every type: few enough to try them all.
ALL = [
    pytest.param(case, role, kind, id=f"{case.family}-{case.op}-{role}-{kind}")
    for case in CASES
    for role in case.roles
    for kind in TYPES
]


@pytest.mark.parametrize(("case", "role", "kind"), ALL)
def test_a_failed_operation_writes_no_key(
    backend: RedisBackend,
    redis_client: redis.Redis,
    case: Any,
    role: str,
    kind: str,
) -> None:
    name = f"every:{uuid.uuid4().hex[:10]}"
    call = _run(backend, case, name)
    key = _key(backend, name, case.family, role)
    if redis_client.type(key).decode() == kind:
        pytest.skip("the key holds that type already")
    _write(redis_client, key, kind)
    before = _snapshot(redis_client, backend, key)
    try:
        try:
            call()
        except LockError:
            after = _snapshot(redis_client, backend, key)
            harmless = {
                _key(backend, name, case.family, role).encode()
                for role in HARMLESS.get((case.family, case.op), ())
            }
            changed = sorted(
                k
                for k in before.keys() | after.keys()
                if before.get(k) != after.get(k) and k not in harmless
            )
            assert not changed, (
                f"{case.family} {case.op} failed on {role} ({kind}) but wrote {changed}"
            )
    finally:
        redis_client.delete(key)
        backend.force_release(name)
        for family in ("semaphore", "read", "write"):
            backend.permit_force_release(family, name, None)
