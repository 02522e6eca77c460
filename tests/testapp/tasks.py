"""Celery tasks run by real worker processes in tests/test_celery.py.

Each run records itself as a :class:`TaskRun` row (in PostgreSQL, from the worker),
so the test can check from the outside which runs overlapped. Tasks that must stay
busy until the test says so wait on a Redis list (``gate``): BLPOP returns as soon
as the test pushes, with a bound so nothing waits forever.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from django.conf import settings

from distlocks.contrib.celery import current_lease, single_execution
from tests.celery_app import app
from tests.testapp.models import TaskRun

GATE_LIMIT = 60


def _start(task: Any, run: str) -> TaskRun:
    lease = current_lease()
    return TaskRun.objects.create(
        run=run,
        task_id=task.request.id or "",
        attempt=task.request.retries or 0,
        pid=os.getpid(),
        fencing_token=lease.fencing_token if lease is not None else None,
        started=time.monotonic(),
    )


def _end(row: TaskRun) -> None:
    row.ended = time.monotonic()
    row.save(update_fields=["ended"])


def _wait_gate(gate: str) -> None:
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        client.blpop([gate], timeout=GATE_LIMIT)
    finally:
        client.close()


def _work(task: Any, run: str, seconds: float) -> None:
    row = _start(task, run)
    time.sleep(seconds)  # the task's own work, not a test waiting for something
    _end(row)


@single_execution(app=app, bind=True, timeout=60)
def serialized(self: Any, run: str, seconds: float) -> None:
    """Duplicates wait for the run lock and run one after another."""
    _work(self, run, seconds)


@single_execution(app=app, bind=True)
def skipped(self: Any, run: str, seconds: float) -> None:
    """Duplicates that find the run lock taken are skipped."""
    _work(self, run, seconds)


@app.task(bind=True)
def unguarded(self: Any, run: str, seconds: float) -> None:
    """The control: the same work with no lock."""
    _work(self, run, seconds)


@single_execution(app=app, bind=True, unique_while="queued_or_running")
def deduplicated(self: Any, run: str, gate: str) -> None:
    """Enqueued 50 times, queued once; stays running until the test opens the gate."""
    row = _start(self, run)
    _wait_gate(gate)
    _end(row)


@single_execution(
    app=app, bind=True, key="crash:{run}", ttl=2, acks_late=True, reject_on_worker_lost=True
)
def crash_prone(self: Any, run: str, gate: str) -> None:
    """Killed by the test mid-run; the redelivered message runs after the lease ends."""
    row = _start(self, run)
    _wait_gate(gate)
    _end(row)


@single_execution(app=app, bind=True, unique_while="queued_or_running", max_retries=3)
def retried(self: Any, run: str) -> None:
    """Calls self.retry() on its first run; the retry must neither deadlock nor overlap."""
    row = _start(self, run)
    _end(row)
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)


@single_execution(app=app, bind=True, key="limited:{run}", ttl=2, time_limit=1)
def time_limited(self: Any, run: str, block: bool) -> None:
    """With ``block`` it outlives its hard time limit and the worker kills it."""
    row = _start(self, run)
    if block:
        _wait_gate(f"never:{run}")
    _end(row)
