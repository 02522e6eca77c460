"""The start of a run with ``unique_while="queued"`` on Redis: the queue marker let go
and the run lock taken in one script (``celery_scripts.RUN_START``), against the two
scripts of the backend it stands for (ACQUIRE, then RELEASE), run on twin names in the
same state. Whatever holds the run lock and the marker, the one script must leave the
keys as the two leave them and answer as ACQUIRE answers: the lock granted only when
free or already this owner's (a call sent again after its reply was lost), a fencing
token above every one issued on the name, the holder record and listing entry written,
the marker gone only if it was this task's. The states: every pair of those below, with
the listing index on and off (off, the script has no index key to drop the marker's
entry from); among them a marker, or its counter, of another type, whose release fails
before or after its first write: the run start reports it exactly when the backend's
RELEASE fails, and leaves what RELEASE leaves half done. Every key of both names is
compared as raw data.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend
from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.scripts import FENCE_GRACE_MS
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from distlocks.locks import current_holder
from tests.celery_app import app

pytestmark = pytest.mark.django_db

OWNER = "run-owner"
MARKER_OWNER = "celery-task:the-task"
_RUN_STATES = ("free", "other", "same-owner", "expired-with-counter", "other-own-waiter")
_MARKER_STATES = (
    "free",
    "own",
    "other",
    "own-with-waiter",
    "own-expired-with-counter",
    "wrong-type",
    "own-with-wrong-type-counter",
)


def _holder() -> Holder:
    holder = current_holder()
    return Holder(holder.host, holder.pid, holder.thread, {"celery_task_id": "the-task"})


def _prepare(backend: Any, client: Any, name: str, run: str, marker: str) -> None:
    holder = _holder()
    keys, marker_keys = backend.all_keys(name), backend.all_keys(name + ":queued")
    if run in ("other", "other-own-waiter"):
        assert backend.acquire(name, "someone-else", 30, holder).acquired
    elif run == "same-owner":
        assert backend.acquire(name, OWNER, 30, holder).acquired
    elif run == "expired-with-counter":
        assert backend.acquire(name, "gone", 30, holder).acquired
        client.delete(keys.lock)
    if run == "other-own-waiter":
        client.zadd(keys.waiters, {OWNER: 2**50})
    if marker in ("own", "own-with-waiter", "own-with-wrong-type-counter"):
        assert backend.acquire(name + ":queued", MARKER_OWNER, 30, holder).acquired
    elif marker == "other":
        assert backend.acquire(name + ":queued", "celery-task:another", 30, holder).acquired
    elif marker == "own-expired-with-counter":
        assert backend.acquire(name + ":queued", MARKER_OWNER, 30, holder).acquired
        client.delete(marker_keys.lock)
    elif marker == "wrong-type":
        client.set(marker_keys.lock, "not a hash")
    if marker == "own-with-waiter":
        client.zadd(marker_keys.waiters, {"waiter": 2**50})
    if marker == "own-with-wrong-type-counter":
        client.delete(marker_keys.fence)
        client.hset(marker_keys.fence, "not", "a counter")


# Fields whose values differ between two grants made a moment apart: compared by
# presence only.
_VARYING = {b"token", b"acquired_at"}


def _raw(backend: Any, client: Any, name: str) -> dict[str, Any]:
    """Every key of ``name`` and of its marker (by its part after the hash tag), as raw
    data with what varies between twin names left out, and the index entries."""
    found: dict[str, Any] = {}
    for suffix in ("", ":queued"):
        keys = backend.all_keys(name + suffix)
        base = keys.lock.removesuffix("lock")
        for key in client.scan_iter(match=base.replace("[", "\\[") + "*", count=1000):
            kind = client.type(key).decode()
            if kind == "hash":
                data: Any = {
                    field: (field in _VARYING) or value.replace(name.encode(), b"<name>")
                    for field, value in client.hgetall(key).items()
                }
                if b"attempts" in data:
                    # The ids of the requests the entry was granted by: one per call,
                    # so only how many are kept can match.
                    data[b"attempts"] = len(client.hget(key, "attempts").split())
            elif kind == "string":
                data = True if key.decode() == keys.fence else client.get(key)
            elif kind == "zset":
                data = client.zrange(key, 0, -1)
            elif kind == "list":
                data = client.lrange(key, 0, -1)
            else:
                data = kind
            ttl = client.pttl(key)
            found[suffix + "|" + key.decode().removeprefix(base)] = (
                kind,
                data,
                # Only what tells the states apart: none, within the grace, past it.
                ttl < 0 or (ttl > FENCE_GRACE_MS and "past"),
            )
        for index in backend._index:
            entry = client.hget(index, name + suffix)
            found[suffix + "|index"] = None if entry is None else entry.split(b"\0")[0]
    return found


@pytest.fixture
def twin_backends(settings: Any) -> Iterator[dict[bool, RedisBackend]]:
    """Two aliases on the session's Redis: the listing index on, and off."""
    prefix = f"rs-{uuid.uuid4().hex[:8]}"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        **{
            f"run-start-index-{on}": {
                "BACKEND": "distlocks.backends.redis.RedisBackend",
                "LOCATION": django_settings.REDIS_URL,
                "OPTIONS": {"key_prefix": f"{prefix}-{on}", "listing_index": on},
            }
            for on in (True, False)
        },
    }
    made = {on: get_backend(f"run-start-index-{on}") for on in (True, False)}
    assert all(isinstance(b, RedisBackend) and celery_redis.usable(b) for b in made.values())
    assert made[True]._index and not made[False]._index
    yield made  # type: ignore[misc]
    for on, backend in made.items():
        keys = list(backend.client.scan_iter(match=f"{prefix}-{on}:*", count=1000))
        if keys:
            backend.client.delete(*keys)


@hsettings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    run=st.sampled_from(_RUN_STATES),
    marker=st.sampled_from(_MARKER_STATES),
    index=st.booleans(),
)
def test_the_run_start_matches_acquire_then_release_in_every_state(
    run: str, marker: str, index: bool, twin_backends: dict[bool, Any]
) -> None:
    backend = twin_backends[index]
    client = backend.client
    ours, theirs = f"rs-{uuid.uuid4().hex}", f"rs-{uuid.uuid4().hex}"
    for name in (ours, theirs):
        _prepare(backend, client, name, run, marker)
    counter = int(client.get(backend.all_keys(ours).fence) or 0)
    holder = _holder()
    two = celery_redis.send_together(
        backend,
        [
            celery_redis.acquire_call(backend, theirs, OWNER, 30, holder),
            celery_redis.release_call(backend, theirs + ":queued", MARKER_OWNER),
        ],
    )
    one = celery_redis.send_together(
        backend,
        [
            celery_redis.run_start_call(
                backend, ours, OWNER, 30, holder, ours + ":queued", MARKER_OWNER
            )
        ],
    )
    assert two is not None and one is not None
    reply, marker_error = celery_redis.run_started(one[0])
    expected, released = two
    # The marker's failure reported as the backend's release reports it, and only then.
    assert bool(marker_error) == isinstance(released, Exception)
    if marker_error:
        assert "WRONGTYPE" in marker_error
    assert reply[0] == expected[0]  # granted or not
    assert (reply[2] > 0) == (expected[2] > 0)  # the lease left, or the holder's
    if reply[0]:
        if run == "same-owner":  # its own grant, answered again: the same token
            assert reply[1] == counter
        else:  # above every token issued on the name
            assert reply[1] > counter
        assert int(client.get(backend.all_keys(ours).fence)) == reply[1]
        assert backend.inspect(ours).fencing_token == reply[1]
    mine, model = _raw(backend, client, ours), _raw(backend, client, theirs)
    # The one difference allowed: the release's tombstone, which nobody reads.
    model = {key: value for key, value in model.items() if "|released:" not in key}
    assert mine == model


def test_a_marker_that_cannot_be_released_does_not_keep_the_run_from_its_lock(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The marker's key holds another type (written by something else): its release
    fails, the run lock is still taken, and the failure is logged, not silent."""
    task = broken_marker_task
    backend = get_backend("default")
    n = uuid.uuid4().int % 10**12
    name = task.lock_name((n,))
    marker_key = backend.all_keys(name + ":queued").lock
    redis_client.set(marker_key, "not a hash")
    app.conf.task_store_eager_result = True
    try:
        with caplog.at_level("WARNING", logger="distlocks.contrib.celery"):
            assert task.apply((n,), task_id=str(uuid.uuid4())).get() == n
    finally:
        app.conf.task_store_eager_result = False
        redis_client.delete(marker_key)
    assert any("Could not release queue marker" in r.getMessage() for r in caplog.records)
    assert backend.inspect(name) is None  # taken, run, released


@single_execution(app=app, name="run_start.broken_marker", unique_while="queued")
def broken_marker_task(n: int) -> int:
    return n
