"""An enqueue with ``unique_while`` where the Celery broker is the lock backend's own
Redis database: the check, the queue marker and the message's publish are one script,
one round trip (two before), and a task from enqueue to the end of its run makes four
(five before), as many as celery-once's and celery-singleton's.

Every count is checked with the state the rules of docs/celery.md require: the
message is on its queue exactly when the marker was taken (never twice, never without
it), a duplicate publishes nothing and gets the queued task's id, a publish the server
refuses leaves no marker, and a broker elsewhere, or a call that subscribes to its
result, takes the plain path. The messages run on real workers in the last test.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.worker.request import Request
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from kombu.exceptions import OperationalError

from distlocks import get_backend
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from distlocks.locks import current_holder
from tests.celery_fold_app import QUEUE, app
from tests.celery_fold_settings import BROKER_DB
from tests.celery_fold_tasks import (
    IDLE_QUEUE,
    RUNS,
    enqueues_twice,
    keeps_result,
    queued,
    queued_or_running,
)
from tests.celery_sends import Sends, count_sends
from tests.celery_workers import celery_workers
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db


#: The same task with its locks on the default backend (another database than the
#: broker's): its publish cannot go in the marker's script.
def _same(n: int) -> int:
    return n


elsewhere = single_execution(
    app=app, name="fold.elsewhere", unique_while="queued", ignore_result=True
)(_same)


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Sends:
    """Requests this thread sends to Redis, to any database."""
    return count_sends(monkeypatch, Sends())


@pytest.fixture
def broker(settings: Any) -> Iterator[redis.Redis]:
    """The broker's database, with the ``"broker-db"`` lock backend on it."""
    settings.DISTLOCKS_BACKENDS = {**settings.DISTLOCKS_BACKENDS, "broker-db": BROKER_DB}
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    client.delete(QUEUE, RUNS)
    yield client
    client.delete(QUEUE, RUNS)
    client.close()


def _n() -> int:
    return uuid.uuid4().int % 10**12


def _marker(task: Any, n: int) -> Any:
    return get_backend("broker-db").inspect(task.lock_name((n,)) + ":queued")


@pytest.fixture
def channel(broker: redis.Redis) -> Iterator[Any]:
    """A broker channel kept open, to fetch the messages as a worker does."""
    with app.connection_for_read() as connection:
        yield connection.default_channel


def _run_next(channel: Any, task: Any) -> Any:
    """Fetch the next message of the queue and run it as a worker does."""
    message = channel.basic_get(QUEUE, no_ack=True)
    assert message is not None
    return Request(message, app=app, task=task, hostname="distlocks-tests").execute()


@pytest.mark.parametrize("task", [queued, queued_or_running], ids=["queued", "queued_or_running"])
def test_an_enqueue_publishes_with_its_marker_in_one_round_trip(
    task: Any, sends: Sends, broker: redis.Redis
) -> None:
    n = _n()
    task.apply_async((n + 1,))  # connected, scripts loaded: what is counted is a call
    sends.reset()
    first = task.apply_async((n,))
    assert sends.count == 1
    assert broker.llen(QUEUE) == 2
    assert _marker(task, n).extra["celery_task_id"] == first.id
    sends.reset()
    again = task.apply_async((n,))
    assert sends.count == 1
    assert again.id == first.id
    assert broker.llen(QUEUE) == 2  # nothing published for the duplicate


def test_a_kombu_release_it_was_not_tested_with_takes_the_plain_path(
    sends: Sends, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fold borrows a private part of kombu 5.7's producer: under any other kombu
    release it is not tried, and the call is the plain two round trips, still one
    message per marker."""
    assert celery_redis._KOMBU_FOLDS  # this suite runs the kombu the fold is for
    monkeypatch.setattr(celery_redis, "_KOMBU_FOLDS", False)
    n = _n()
    queued.apply_async((n + 1,))
    sends.reset()
    first = queued.apply_async((n,))
    assert sends.count == 2
    again = queued.apply_async((n,))
    assert again.id == first.id
    assert broker.llen(QUEUE) == 2
    assert _marker(queued, n).extra["celery_task_id"] == first.id


@pytest.mark.parametrize("task", [queued, queued_or_running], ids=["queued", "queued_or_running"])
def test_a_task_from_enqueue_to_the_end_of_its_run_makes_four_round_trips(
    task: Any, sends: Sends, broker: redis.Redis, channel: Any
) -> None:
    """Publish (with the marker), fetch, run lock (with the marker's call), release:
    what ``celery-cycle`` in bench/ measures; the message pushed by the script is the
    one kombu would have published, run by Celery's worker ``Request``."""
    n = _n()
    task.apply_async((n + 1,))
    assert _run_next(channel, task) == n + 1
    sends.reset()
    sent = task.apply_async((n,))
    assert _run_next(channel, task) == n
    assert sends.count == 4 + 1  # and the body's own note of its run
    assert broker.lrange(RUNS, 0, -1)[-1].decode() == sent.id
    assert _marker(task, n) is None
    assert get_backend("broker-db").inspect(task.lock_name((n,))) is None
    assert broker.llen(QUEUE) == 0


def test_a_push_the_server_refuses_writes_nothing(broker: redis.Redis) -> None:
    """The push comes first in the script: refused (the queue's key holds a string),
    no marker is written, and the call, made the plain way, fails as Celery's publish
    fails, leaving no marker either."""
    n = _n()
    backend = get_backend("broker-db")
    marker = queued.lock_name((n,)) + ":queued"
    broker.set(QUEUE, "not a list")
    answer = celery_redis.enqueue(
        backend, marker, "celery-task:x", 60.0, current_holder(), None,
        sends=[("lpush", QUEUE, "a message")],
    )  # fmt: skip
    assert answer is None
    assert backend.inspect(marker) is None
    with pytest.raises((redis.ResponseError, OperationalError), match="WRONGTYPE"):
        queued.apply_async((n,))
    assert backend.inspect(marker) is None
    assert broker.get(QUEUE) == b"not a list"


def test_a_call_sent_again_after_its_reply_was_lost_publishes_once(broker: redis.Redis) -> None:
    """A connection broken after the server ran the script makes the client send the
    very same call again: the marker is this call's own, so the message went with it
    and is not pushed a second time."""
    n = _n()
    backend = get_backend("broker-db")
    marker = queued.lock_name((n,)) + ":queued"
    call = (backend, marker, "celery-task:y", 60.0, current_holder(), None)
    pushes = [("lpush", QUEUE, "the message")]
    first = celery_redis.enqueue(*call, sends=pushes)
    again = celery_redis.enqueue(*call, sends=pushes)
    assert first is not None and first[0] == celery_redis.TAKEN and first[1].acquired
    assert again is not None and again[0] == celery_redis.TAKEN and again[1].acquired
    assert broker.lrange(QUEUE, 0, -1) == [b"the message"]
    assert backend.inspect(marker).owner == "celery-task:y"


def test_a_broker_on_another_database_takes_the_plain_path(
    sends: Sends, broker: redis.Redis
) -> None:
    """Locks on the default backend (database 0), broker on database 1: the marker's
    script and the publish are two round trips, and the message is on the broker."""
    n = _n()
    elsewhere.apply_async((n + 1,))
    sends.reset()
    sent = elsewhere.apply_async((n,))
    assert sends.count == 2
    assert broker.llen(QUEUE) == 2
    info = get_backend("default").inspect(elsewhere.lock_name((n,)) + ":queued")
    assert info.extra["celery_task_id"] == sent.id


def test_a_call_that_keeps_its_result_is_folded_and_a_duplicate_leaves_no_subscription(
    sends: Sends, broker: redis.Redis
) -> None:
    """The suite's Redis result backend subscribes a call that keeps its result before
    the publish: a duplicate, answered from inside the publish with another task's id,
    drops the subscription of the id it was given and will never use."""
    n = _n()
    consumer = keeps_result.backend.result_consumer
    keeps_result.apply_async((n + 1,))
    lock_db = int(BROKER_DB["LOCATION"].rsplit("/", 1)[-1])
    sends.reset()
    first = keeps_result.apply_async((n,))
    assert sends.by_db.get(lock_db) == 1
    subscribed = set(consumer.subscribed_to)
    assert consumer._get_key_for_task(first.id) in subscribed
    sends.reset()
    again = keeps_result.apply_async((n,))
    assert sends.by_db.get(lock_db) == 1
    assert again.id == first.id
    assert set(consumer.subscribed_to) == subscribed
    assert broker.llen(QUEUE) == 2


_KEYS = st.integers(min_value=0, max_value=2)
#: How a call is made: options that leave its key and its queue as they are (a
#: priority would change the order the model expects the runs in).
_CALLS = st.sampled_from(
    [
        {},
        {"countdown": 0},
        {"expires": 3600},
        {"headers": {"x-note": "a"}},
        {"compression": "zlib"},
        {"queue": QUEUE},
        "delay",
        "signature",
    ]
)
_STEPS = st.lists(
    st.one_of(st.tuples(st.just("enqueue"), _KEYS, _CALLS), st.just(("run", 0, {}))),
    max_size=12,
)


def _call(key: int, how: Any) -> Any:
    """``queued`` of ``key``, called as ``how`` says (see _CALLS)."""
    if how == "delay":
        return queued.delay(key)
    if how == "signature":
        return queued.s(key).apply_async()
    return queued.apply_async((key,), **how)


@hsettings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=_STEPS)
def test_the_queue_holds_one_message_per_marker_in_any_order_of_calls_and_runs(
    steps: list[tuple[str, int, Any]], sends: Sends, broker: redis.Redis, channel: Any
) -> None:
    """Against a model: a key is queued from its first call until its message runs;
    a call on a queued key gets its id and publishes nothing, any other call
    publishes one message, in one round trip; runs come in the queue's order."""
    base = _n()
    queued.apply_async((base + 100,))  # connected, scripts loaded
    _run_next(channel, queued)
    broker.delete(RUNS)
    waiting: list[tuple[int, str]] = []  # the queue, oldest first: (key, task id)
    ran: list[str] = []
    try:
        for step, key, how in steps:
            if step == "enqueue":
                sends.reset()
                result = _call(base + key, how)
                assert sends.count == 1
                known = {k: task_id for k, task_id in waiting}
                if key in known:
                    assert result.id == known[key]
                else:
                    waiting.append((key, result.id))
            elif waiting:
                key, task_id = waiting.pop(0)
                assert _run_next(channel, queued) == base + key
                ran.append(task_id)
            assert broker.llen(QUEUE) == len(waiting)
            for k in range(3):
                marker = _marker(queued, base + k)
                known = {k2: task_id for k2, task_id in waiting}
                if k in known:
                    assert marker is not None and marker.extra["celery_task_id"] == known[k]
                else:
                    assert marker is None
        assert [run.decode() for run in broker.lrange(RUNS, 0, -1)] == ran
    finally:
        while broker.llen(QUEUE):
            _run_next(channel, queued)
        broker.delete(RUNS)


@pytest.fixture(scope="module")
def fold_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """One worker process (prefork, concurrency 2) on the fold tasks' queue, with the
    ``"broker-db"`` backend."""
    logs = tmp_path_factory.mktemp("celery-fold")
    one = [("fold1", ["--concurrency", "2", "-Q", QUEUE])]
    with celery_workers(
        app, "tests.celery_fold_app", logs, one, settings="tests.celery_fold_settings"
    ) as pids:
        yield pids


def test_published_messages_run_once_each_on_a_worker(
    broker: redis.Redis, fold_workers: list[int]
) -> None:
    """A burst of calls, each key three times: every id handed out names a message
    the script published, each runs exactly once on the worker (and a result kept is
    stored), and the keys are free afterwards."""
    base = _n()
    tasks = (queued, queued_or_running, keeps_result)
    calls = [
        (task, base + k, task.apply_async((base + k,)).id)
        for _, k, task in itertools.product(range(3), range(10), tasks)
    ]
    published = {task_id for _, _, task_id in calls}

    def runs() -> list[str]:
        return [run.decode() for run in broker.lrange(RUNS, 0, -1)]

    wait_for(lambda: len(runs()) >= len(published), limit=60, what="the runs on the worker")
    wait_for(lambda: broker.llen(QUEUE) == 0, limit=30, what="an empty queue")
    assert sorted(runs()) == sorted(published)  # each published message ran once
    for task, n, task_id in calls:
        if task is keeps_result:
            assert task.AsyncResult(task_id).get(timeout=30) == n
    backend = get_backend("broker-db")
    for task, n, _ in calls:
        name = task.lock_name((n,))
        wait_for(
            lambda name=name: backend.inspect(name) is None
            and backend.inspect(name + ":queued") is None,
            limit=30, what=f"{name} and its marker free",
        )  # fmt: skip


def test_a_run_on_a_worker_queues_a_task_and_its_duplicate_once(
    broker: redis.Redis, fold_workers: list[int], channel: Any
) -> None:
    """A task run in a worker's pool process (forked from the worker) calls
    ``apply_async()`` of another task twice with one key (onto a queue no worker
    reads): one message, which runs, and both calls were given its id."""
    n = _n()
    broker.delete(IDLE_QUEUE)
    enqueues_twice.apply_async((n,))

    def runs() -> list[str]:
        return [run.decode() for run in broker.lrange(RUNS, 0, -1)]

    wait_for(lambda: any(r.startswith("enqueued:") for r in runs()), limit=60, what="the run")
    _, first, again = next(r for r in runs() if r.startswith("enqueued:")).split(":")
    assert first == again
    assert broker.llen(IDLE_QUEUE) == 1
    message = channel.basic_get(IDLE_QUEUE, no_ack=True)
    assert message is not None and message.headers["id"] == first
    assert Request(message, app=app, task=queued, hostname="distlocks-tests").execute() == n
