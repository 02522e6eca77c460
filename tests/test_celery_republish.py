"""A message a run publishes under its own id (``self.retry()``, ``self.replace()``)
and the queue marker: kept for a message that was published, given back for one that
was not.

The runs go through Celery's tracer as a worker's do (``trace_task``, not eager: an
eager retry or replacement runs in place and publishes nothing), in this process,
against the real Redis broker or a broker that is down.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import trace_task

from distlocks import get_backend
from distlocks.contrib.celery import single_execution
from tests.celery_app import app

pytestmark = pytest.mark.django_db

IDLE_QUEUE = "distlocks-tests-republish"

dead = Celery("dead-broker-republish", broker="redis://127.0.0.1:9/0", set_as_current=False)
dead.conf.broker_connection_timeout = 0.5


def _run_as_a_worker(task: Any, task_id: str, args: tuple[Any, ...]) -> Any:
    """Run ``task`` through Celery's tracer as a worker does (not eager)."""
    request = {"id": task_id, "retries": 0, "is_eager": False, "delivery_info": {}}
    return trace_task(task, task_id, args, {}, request, app=task._get_app(), eager=False)


def _retry_on_a_dead_broker(self: Any, n: int) -> None:
    raise self.retry(countdown=1, retry=False)


@pytest.mark.parametrize("mode", ["queued", "queued_or_running"])
def test_a_retry_that_could_not_be_published_leaves_no_marker(mode: str) -> None:
    """The retry's publish fails (the broker is down): no marker may keep duplicates
    away from a task that nothing will run, whichever mode took it."""
    task = single_execution(
        app=dead, name=f"republish.dead.{mode}", unique_while=mode, bind=True,
        ignore_result=True,
    )(_retry_on_a_dead_broker)  # fmt: skip
    n = uuid.uuid4().int % 10**12
    task_id = str(uuid.uuid4())
    _run_as_a_worker(task, task_id, (n,))
    backend = get_backend("default")
    assert backend.inspect(task.lock_name((n,)) + ":queued") is None
    assert backend.inspect(task.lock_name((n,))) is None


replaced_runs: list[int] = []


@single_execution(
    app=app, name="republish.replaced", key="republish-replaced:{n}",
    unique_while="queued_or_running", bind=True, ignore_result=True,
)  # fmt: skip
def replaced(self: Any, n: int) -> None:
    replaced_runs.append(n)
    # Hand the work on to a new message under this id (on a queue nobody consumes).
    raise self.replace(self.si(n).set(queue=IDLE_QUEUE))


def test_a_replaced_task_stays_deduplicated_while_its_replacement_is_queued(
    broker: redis.Redis,
) -> None:
    """``self.replace()`` publishes the replacement under the task's own id and ends
    the run: the marker is kept for the queued replacement, so a duplicate call still
    gets the task's id instead of queueing a second copy."""
    n = uuid.uuid4().int % 10**12
    first = replaced.apply_async((n,), queue=IDLE_QUEUE)
    assert broker.llen(IDLE_QUEUE) == 1
    broker.delete(IDLE_QUEUE)  # the worker took the message
    _run_as_a_worker(replaced, first.id, (n,))
    assert replaced_runs[-1] == n
    assert broker.llen(IDLE_QUEUE) == 1  # the replacement
    marker = get_backend("default").inspect(f"republish-replaced:{n}:queued")
    assert marker is not None and marker.extra["celery_task_id"] == first.id
    again = replaced.apply_async((n,), queue=IDLE_QUEUE)
    assert again.id == first.id
    assert broker.llen(IDLE_QUEUE) == 1
    get_backend("default").force_release(f"republish-replaced:{n}:queued")
