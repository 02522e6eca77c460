"""Celery tasks of issue 25's tests (bursts, canvas, redelivery, retries), run by the
real worker processes that tests/test_celery.py starts.

Like tests.testapp.tasks, each run records a :class:`TaskRun` row, and tasks that
must stay busy until the test says so wait on a Redis list (the gate).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from django.conf import settings

from distlocks.contrib.celery import single_execution
from tests.celery_app import app
from tests.testapp.models import TaskRun
from tests.testapp.tasks import GATE_LIMIT, _end, _start


def _wait_gate(gate: str) -> None:
    """Until the test opens ``gate`` (or GATE_LIMIT passes). BLPOP a second at a time:
    a worker process's sockets may carry a default timeout shorter than the wait."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    deadline = time.monotonic() + GATE_LIMIT
    try:
        while time.monotonic() < deadline and client.blpop([gate], timeout=1) is None:
            pass
    finally:
        client.close()


@single_execution(app=app, bind=True, key="burst:{run}", unique_while="queued_or_running")
def burst(self: Any, run: str, gate: str) -> str:
    """Stays running until the gate opens; bursts of duplicates are made meanwhile."""
    row = _start(self, run)
    _wait_gate(gate)
    _end(row)
    return f"ran:{self.request.id}"


@single_execution(app=app, bind=True, key="canvas:{run}", unique_while="queued_or_running")
def canvas_head(self: Any, run: str, gate: str) -> str:
    """The deduplicated task of the canvas tests (its first copy waits on the gate)."""
    row = _start(self, run)
    _wait_gate(gate)
    _end(row)
    return "head"


@app.task(bind=True)
def record(self: Any, value: Any, run: str) -> Any:
    """A plain task that records that it ran (as a link, chain step or chord part)."""
    _end(_start(self, run))
    return value


@app.task(bind=True)
def record_error(self: Any, failed_id: str, run: str) -> str:
    """A link_error callback: records the id of the task that failed."""
    TaskRun.objects.create(run=run, task_id=failed_id, attempt=0, pid=0, started=0.0)
    return failed_id


@app.task
def collect(results: list[Any]) -> list[Any]:
    """A chord body."""
    return results


@single_execution(app=app, bind=True, key="redelivered:{run}", ttl=5, acks_late=True)
def redelivered(self: Any, run: str, gate: str) -> str:
    """Published twice under one id (as the broker does after the visibility timeout):
    the second delivery meets the first still running."""
    row = _start(self, run)
    _wait_gate(gate)
    _end(row)
    return "the real result"


@single_execution(app=app, bind=True, key="retry-claim:{run}", ttl=5, max_retries=3)
def retry_once(self: Any, run: str, gate: str, countdown: float) -> str:
    """The first attempt retries after ``countdown``; later attempts (and copies) wait
    on the gate, so a copy enqueued during the countdown would still be running when
    the retry arrives."""
    row = _start(self, run)
    if self.request.retries == 0:
        _end(row)
        raise self.retry(countdown=countdown)
    _wait_gate(gate)
    _end(row)
    return f"done:{self.request.retries}"


@single_execution(
    app=app, bind=True, key="model:{run}", ttl=5, unique_while="queued_or_running",
    acks_late=True, reject_on_worker_lost=True, max_retries=2,
)  # fmt: skip
def modelled(self: Any, run: str, gate: str, retries: int) -> str:
    """The task of the stateful test: retries ``retries`` times (countdown 0.5 s),
    then waits on the gate; records every attempt."""
    row = _start(self, run)
    if self.request.retries < retries:
        _end(row)
        raise self.retry(countdown=0.5)
    _wait_gate(gate)
    _end(row)
    return f"done:{self.request.id}:{self.request.retries}"
