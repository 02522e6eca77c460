"""Round trips to the lock server of a single-execution task, and the one-step checks
that let the run lock and the queue marker share them.

A run or an enqueue is counted by the requests this thread sends to the lock server
(the broker and the result backend are other Redis databases on the same server and
are not counted): a pipeline of several commands is one round trip. Every count is
checked with the state the rules of docs/celery.md require, so a path that saved a
round trip by skipping a step fails here.
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
from distlocks.contrib.celery import single_execution
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.locks import current_holder
from tests.celery_app import app
from tests.celery_sends import Sends, count_sends
from tests.redis_clients import kill_own_connections

pytestmark = pytest.mark.django_db

#: A queue no worker consumes: messages published there stay put for inspection.
IDLE_QUEUE = "distlocks-tests-round-trips"


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Sends:
    """Requests this thread sends to the lock server's database."""
    backend = get_backend("default")
    db = int(backend.client.connection_pool.connection_kwargs.get("db", 0))
    return count_sends(monkeypatch, Sends(db))


def _trivial(n: int) -> int:
    return n


plain_run = single_execution(app=app, name="trips.plain")(_trivial)
queued = single_execution(app=app, name="trips.queued", unique_while="queued")(_trivial)
inside: list[Any] = []


@single_execution(
    app=app, name="trips.qor", key="trips-qor:{n}", unique_while="queued_or_running", bind=True
)  # fmt: skip
def queued_or_running(self: Any, n: int) -> int:
    backend = get_backend("default")
    inside.append((backend.inspect(f"trips-qor:{n}"), backend.inspect(f"trips-qor:{n}:queued")))
    return n


def _n() -> int:
    return uuid.uuid4().int % 10**12


def test_a_run_takes_the_run_lock_and_gives_it_back_in_two_round_trips(sends: Sends) -> None:
    n = _n()
    plain_run.apply((n + 1,))  # connected, scripts loaded: what is counted is the run
    sends.count = 0
    assert plain_run.apply((n,)).get() == n
    assert sends.count == 2
    assert get_backend("default").inspect(plain_run.lock_name((n,))) is None


def test_a_queued_run_lets_its_marker_go_with_the_run_lock_in_one_round_trip(
    sends: Sends, broker: redis.Redis
) -> None:
    """unique_while="queued": taking the run lock and letting the marker go are one
    round trip (two before), in that order; the run then releases its lock."""
    n = _n()
    backend = get_backend("default")
    warm = queued.apply_async((n + 1,), queue=IDLE_QUEUE)
    queued.apply((n + 1,), task_id=warm.id)
    sent = queued.apply_async((n,), queue=IDLE_QUEUE)
    marker = queued.lock_name((n,)) + ":queued"
    assert backend.inspect(marker).extra["celery_task_id"] == sent.id
    sends.reset()
    # What the worker does with the message: the same id, not eager.
    assert queued.apply((n,), task_id=sent.id).get() == n
    assert sends.count == 2
    # The run lock's grant and the marker's release are one script (two before: each
    # script a server runs costs more than the commands in it), and the run's end one.
    assert sends.writes == 2
    assert sends.scripts == 2
    assert backend.inspect(marker) is None
    assert backend.inspect(queued.lock_name((n,))) is None


def test_a_queued_or_running_run_keeps_its_marker_and_takes_both_in_one_round_trip(
    sends: Sends, broker: redis.Redis
) -> None:
    """unique_while="queued_or_running": the marker taken over and the run lock taken
    are one round trip (two before); both are held while the body runs, by this task."""
    n = _n()
    backend = get_backend("default")
    warm = queued_or_running.apply_async((n + 1,), queue=IDLE_QUEUE)
    sent = queued_or_running.apply_async((n,), queue=IDLE_QUEUE)
    app.conf.task_store_eager_result = True  # a stored result: run as a worker runs it
    try:
        queued_or_running.apply((n + 1,), task_id=warm.id)
        inside.clear()
        sends.reset()
        assert queued_or_running.apply((n,), task_id=sent.id).get() == n
        trips, writes = sends.count, sends.writes
    finally:
        app.conf.task_store_eager_result = False
    # The acquire of both, then the release of both (four round trips before), and
    # the body's own two inspections; the result backend is not the lock server's.
    assert trips == 2 + 2
    assert writes == trips  # each pair of calls in one write
    ((run, marker),) = inside
    assert run is not None and run.extra["celery_task_id"] == sent.id
    assert marker is not None and marker.extra["celery_task_id"] == sent.id
    assert backend.inspect(f"trips-qor:{n}") is None
    assert backend.inspect(f"trips-qor:{n}:queued") is None


@single_execution(
    app=app, name="trips.qor_lost", key="trips-lost:{n}", unique_while="queued_or_running"
)  # fmt: skip
def loses_its_lock(n: int) -> int:
    get_backend("default").force_release(f"trips-lost:{n}")  # an operator frees it
    return n


def test_a_run_lock_lost_while_running_fails_the_task_and_still_frees_the_marker(
    broker: redis.Redis,
) -> None:
    """The releases sent together report as the plain ones: a run lock lost while the
    body ran fails the task with LockLost, and the marker is let go all the same."""
    n = _n()
    backend = get_backend("default")
    sent = loses_its_lock.apply_async((n,), queue=IDLE_QUEUE)
    app.conf.task_store_eager_result = True
    try:
        result = loses_its_lock.apply((n,), task_id=sent.id)
    finally:
        app.conf.task_store_eager_result = False
    assert result.failed()
    assert isinstance(result.result, LockLost), result.result
    assert backend.inspect(f"trips-lost:{n}:queued") is None
    assert backend.inspect(f"trips-lost:{n}") is None


@pytest.mark.parametrize("task", [queued, queued_or_running], ids=["queued", "queued_or_running"])
def test_an_enqueue_and_a_duplicate_take_one_round_trip_each(
    task: Any, sends: Sends, broker: redis.Redis
) -> None:
    """The check for a running copy, the marker, and the answer to a duplicate (the
    holder's task id) are one script: one round trip per call (two or three before)."""
    n = _n()
    task.apply_async((n + 1,), queue=IDLE_QUEUE)
    task.apply_async((n + 1,), queue=IDLE_QUEUE)
    sends.count = 0
    first = task.apply_async((n,), queue=IDLE_QUEUE)
    assert sends.count == 1
    sends.count = 0
    again = task.apply_async((n,), queue=IDLE_QUEUE)
    assert sends.count == 1
    assert again.id == first.id
    assert broker.llen(IDLE_QUEUE) == 2


# -- the one-step enqueue check against the rules, over every state of the two locks --

_RUN_STATES = ("free", "task", "eager", "not-a-task")
_MARKER_STATES = ("free", "own", "task", "not-a-task")


def _holder(extra: dict[str, str]) -> Holder:
    holder = current_holder()
    return Holder(host=holder.host, pid=holder.pid, thread=holder.thread, extra=extra)


@hsettings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    mode=st.sampled_from(["queued", "queued_or_running"]),
    run_state=st.sampled_from(_RUN_STATES),
    marker_state=st.sampled_from(_MARKER_STATES),
)
def test_the_enqueue_check_follows_the_rules_in_every_state(
    mode: str, run_state: str, marker_state: str, broker: redis.Redis
) -> None:
    """Whatever holds the run lock and the marker, an enqueue answers as the rules
    say: a running task (with "queued_or_running") or a queued copy is returned and
    nothing is published; a marker held by no task refuses the call; otherwise the
    call is published and owns the marker. Nothing else changes."""
    task = queued if mode == "queued" else queued_or_running
    backend = get_backend("default")
    n = _n()
    name = task.lock_name((n,))
    marker = name + ":queued"
    task_id = str(uuid.uuid4())
    taken: list[tuple[str, str]] = []
    if run_state != "free":
        extra = {
            "task": {"celery_task_id": "running-id"},
            "eager": {"celery_task_id": "eager-id", "celery_eager": "1"},
            "not-a-task": {"user": "someone"},
        }[run_state]
        assert backend.acquire(name, "run-owner", 30, _holder(extra)).acquired
        taken.append((name, "run-owner"))
    if marker_state != "free":
        owner = f"celery-task:{task_id}" if marker_state == "own" else "marker-owner"
        extra = {"celery_task_id": "queued-id"} if marker_state == "task" else {"user": "someone"}
        if marker_state == "own":
            extra = {"celery_task_id": task_id}
        assert backend.acquire(marker, owner, 30, _holder(extra)).acquired
        taken.append((marker, owner))
    before = broker.llen(IDLE_QUEUE)
    try:
        if mode == "queued_or_running" and run_state == "task":
            expected: str | None = "running-id"
        elif marker_state == "task":
            expected = "queued-id"
        elif marker_state == "not-a-task":
            with pytest.raises(LockNotAcquired):
                task.apply_async((n,), task_id=task_id, queue=IDLE_QUEUE)
            assert broker.llen(IDLE_QUEUE) == before
            info = backend.inspect(marker)
            assert info is not None and info.owner == "marker-owner"
            return
        else:
            expected = None
        result = task.apply_async((n,), task_id=task_id, queue=IDLE_QUEUE)
        info = backend.inspect(marker)
        if expected is not None:
            assert result.id == expected
            assert broker.llen(IDLE_QUEUE) == before
            if marker_state == "free":
                assert info is None  # never taken, so never given back
        else:
            assert result.id == task_id
            assert broker.llen(IDLE_QUEUE) == before + 1
            assert info is not None and info.owner == f"celery-task:{task_id}"
            assert info.extra["celery_task_id"] == task_id
            taken.append((marker, f"celery-task:{task_id}"))
        if run_state != "free":
            run = backend.inspect(name)
            assert run is not None and run.owner == "run-owner"
    finally:
        for lock_name, owner in taken:
            backend.release_quietly(lock_name, owner)
        broker.delete(IDLE_QUEUE)


def test_the_calls_sent_together_survive_a_flushed_script_cache(
    redis_client: redis.Redis, broker: redis.Redis
) -> None:
    """After a restart or SCRIPT FLUSH the server knows none of the scripts: the enqueue
    script and the pipelined calls load them again and go on, in their order."""
    backend = get_backend("default")
    for task, marker_of in (
        (queued, lambda n: queued.lock_name((n,)) + ":queued"),
        (queued_or_running, lambda n: f"trips-qor:{n}:queued"),
    ):
        n = _n()
        redis_client.script_flush()
        sent = task.apply_async((n,), queue=IDLE_QUEUE)
        info = backend.inspect(marker_of(n))
        assert info is not None and info.extra["celery_task_id"] == sent.id
        redis_client.script_flush()
        app.conf.task_store_eager_result = True
        try:
            assert task.apply((n,), task_id=sent.id).get() == n
        finally:
            app.conf.task_store_eager_result = False
        assert backend.inspect(marker_of(n)) is None
        assert backend.inspect(task.lock_name((n,))) is None


def test_the_calls_sent_together_survive_a_broken_connection(
    redis_client: redis.Redis, broker: redis.Redis
) -> None:
    """The server drops this process's connections (a restart, a proxy): the next run
    makes its calls again on a new connection, and ends with both locks free."""
    backend = get_backend("default")
    n = _n()
    sent = queued_or_running.apply_async((n,), queue=IDLE_QUEUE)
    assert kill_own_connections(redis_client) >= 1  # not the workers' nor anyone else's
    app.conf.task_store_eager_result = True
    try:
        assert queued_or_running.apply((n,), task_id=sent.id).get() == n
    finally:
        app.conf.task_store_eager_result = False
    assert backend.inspect(f"trips-qor:{n}:queued") is None
    assert backend.inspect(f"trips-qor:{n}") is None
