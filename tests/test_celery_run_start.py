"""The start of a run with ``unique_while="queued"`` on Redis: the queue marker let go
and the run lock taken in one script (``celery_scripts.RUN_START``), against the two
scripts of the backend it stands for (ACQUIRE, then RELEASE), run on twin names in the
same state. Whatever holds the run lock and the marker, the one script must leave the
keys as the two leave them and answer as ACQUIRE answers: the lock granted only when
free or already this owner's (a call sent again after its reply was lost), a fencing
token above every one issued on the name, the holder record and listing entry written,
the marker gone only if it was this task's.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend
from distlocks.backends.base import Holder
from distlocks.backends.redis.scripts import FENCE_GRACE_MS
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from distlocks.locks import current_holder
from tests.celery_app import app

pytestmark = pytest.mark.django_db

OWNER = "run-owner"
MARKER_OWNER = "celery-task:the-task"
_RUN_STATES = ("free", "other", "same-owner", "expired-with-counter")
_MARKER_STATES = ("free", "own", "other", "own-with-waiter")


def _holder() -> Holder:
    holder = current_holder()
    return Holder(holder.host, holder.pid, holder.thread, {"celery_task_id": "the-task"})


def _prepare(backend: Any, client: redis.Redis, name: str, run: str, marker: str) -> None:
    holder = _holder()
    if run == "other":
        assert backend.acquire(name, "someone-else", 30, holder).acquired
    elif run == "same-owner":
        assert backend.acquire(name, OWNER, 30, holder).acquired
    elif run == "expired-with-counter":
        assert backend.acquire(name, "gone", 30, holder).acquired
        client.delete(backend.all_keys(name).lock)  # ran out; its counter stays
    if marker in ("own", "own-with-waiter"):
        assert backend.acquire(name + ":queued", MARKER_OWNER, 30, holder).acquired
    elif marker == "other":
        assert backend.acquire(name + ":queued", "celery-task:another", 30, holder).acquired
    if marker == "own-with-waiter":
        client.zadd(backend.all_keys(name + ":queued").waiters, {"waiter": 2**50})


def _state(backend: Any, client: redis.Redis, name: str) -> dict[str, Any]:
    run, marker = backend.inspect(name), backend.inspect(name + ":queued")
    # The listing index's entries (owner first), as the admin page and the CLI read them.
    (index,) = backend._index
    entries = {suffix: client.hget(index, name + suffix) for suffix in ("", ":queued")}
    listed = {suffix: entry.split(b"\0")[0] for suffix, entry in entries.items() if entry}
    keys = backend.all_keys(name + ":queued")
    return {
        "run": None if run is None else (run.owner, run.extra, run.ttl),
        "marker": None if marker is None else marker.owner,
        "listed": listed,
        "marker counter lives": client.exists(keys.fence) == 1,
        # Kept only past the clock and the grace once the marker is released, not
        # for the rest of its lease: per-call names leave no keys behind.
        "marker counter kept past the grace": client.pttl(keys.fence) > FENCE_GRACE_MS,
        "marker released tombstone": bool(
            list(client.scan_iter(match=keys.lock.removesuffix("lock") + "released:*"))
        ),
        "woken": client.llen(keys.signal),
    }


@hsettings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(run=st.sampled_from(_RUN_STATES), marker=st.sampled_from(_MARKER_STATES))
def test_the_run_start_script_does_what_acquire_then_release_do(
    run: str, marker: str, redis_client: redis.Redis
) -> None:
    backend = get_backend("default")
    ours, theirs = f"rs-{uuid.uuid4().hex}", f"rs-{uuid.uuid4().hex}"
    for name in (ours, theirs):
        _prepare(backend, redis_client, name, run, marker)
    counters = {
        name: int(redis_client.get(backend.all_keys(name).fence) or 0) for name in (ours, theirs)
    }
    holder = _holder()
    # The backend's two scripts, pipelined as the run start sent them before.
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
    expected = two[0]
    assert marker_error == ""
    assert reply[0] == expected[0]  # granted or not
    assert (reply[2] > 0) == (expected[2] > 0)  # the lease left, or the holder's
    if reply[0]:
        if run == "same-owner":  # its own grant, answered again: the same token
            assert reply[1] == counters[ours]
        else:  # above every token issued on the name
            assert reply[1] > counters[ours]
        assert int(redis_client.get(backend.all_keys(ours).fence)) == reply[1]
        assert backend.inspect(ours).fencing_token == reply[1]
    mine, model = _state(backend, redis_client, ours), _state(backend, redis_client, theirs)
    # The one difference allowed: no tombstone for the marker's release, whose answer
    # nobody reads.
    model["marker released tombstone"] = False
    assert mine == model
    for name in (ours, theirs):
        redis_client.delete(*redis_client.keys(f"*{{{name}*"))
        for key in backend._index:
            redis_client.hdel(key, name, name + ":queued")


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
