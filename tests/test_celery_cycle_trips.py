"""Round trips to the lock server of a whole task, enqueue to end of run, on the
worker's own path (the message fetched from the broker and run by Celery's worker
``Request``, not eager): what ``celery-cycle`` in bench/ measures, counted.

tests/test_celery_round_trips.py counts each end with ``apply()``; this runs the ends
as production does, so that a run path that only a worker takes (a stored result, a
request that is not eager) cannot add a round trip unseen. The counts are the floor of
the rules in docs/celery.md: the run lock is taken before the body (one round trip,
the marker's call sent with it) and released after it with its answer read (one), and
the enqueue check is one script; the peers' four per task (marker, publish, fetch,
delete) have no run lock. Here the broker is another database, so the publish is a
round trip of its own (five in all); where the broker is the lock server's database,
the marker's script pushes the message and a task makes four in all
(tests/test_celery_fold.py counts them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.worker.request import Request
from django.conf import settings

from distlocks import get_backend
from distlocks.contrib.celery import single_execution
from tests.celery_app import app
from tests.celery_sends import Sends
from tests.test_celery_round_trips import sends  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db

#: A queue no worker consumes: the test fetches its messages itself.
QUEUE = "distlocks-tests-cycle-trips"
seen: list[tuple[str, bool]] = []


def _record(task: Any, n: int) -> int:
    seen.append((task.request.id, task.request.is_eager))
    return n


run_lock_only = single_execution(app=app, name="cycle.plain", bind=True)(_record)
queued = single_execution(app=app, name="cycle.queued", unique_while="queued", bind=True)(_record)
queued_or_running = single_execution(
    app=app, name="cycle.qor", unique_while="queued_or_running", bind=True
)(_record)


@pytest.fixture
def channel() -> Iterator[Any]:
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(QUEUE)
    with app.connection_for_read() as connection:
        yield connection.default_channel
    client.delete(QUEUE)
    client.close()


def _cycle(task: Any, channel: Any, n: int) -> str:
    """Publish, fetch and run one task as a worker does; its id."""
    sent = task.apply_async((n,), queue=QUEUE)
    message = channel.basic_get(QUEUE, no_ack=True)
    assert message is not None
    Request(message, app=app, task=task, hostname="distlocks-tests").execute()
    return str(sent.id)


@pytest.mark.parametrize(
    ("task", "trips"),
    [(run_lock_only, 2), (queued, 3), (queued_or_running, 3)],
    ids=["run-lock-only", "queued", "queued_or_running"],
)
def test_a_task_from_enqueue_to_the_end_of_its_run(
    task: Any,
    trips: int,
    sends: Sends,  # noqa: F811 - the fixture imported above
    channel: Any,
) -> None:
    backend = get_backend("default")
    n = uuid.uuid4().int % 10**12
    _cycle(task, channel, n + 1)  # connected, scripts loaded: what is counted is a task
    seen.clear()
    sends.count = 0
    task_id = _cycle(task, channel, n)
    assert sends.count == trips
    assert seen == [(task_id, False)]  # run once, by the worker's path
    name = task.lock_name((n,))
    assert backend.inspect(name) is None
    assert backend.inspect(name + ":queued") is None
    assert task.AsyncResult(task_id).get(timeout=10) == n
