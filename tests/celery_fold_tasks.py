"""The tasks of tests/test_celery_fold.py (app: :mod:`tests.celery_fold_app`).

Each run notes its task id on a Redis list, for the tests to count the runs. All but
``keeps_result`` keep no result: with the suite's Redis result backend, a call that
keeps its result is subscribed to it before the publish, which a duplicate undoes.
"""

from __future__ import annotations

from typing import Any

import redis

from distlocks.contrib.celery import single_execution
from tests.celery_fold_app import app

#: Where each run notes its task id (on the broker's database).
RUNS = "distlocks-tests-fold:runs"

_client: Any = None


def _note(self: Any, n: int) -> int:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(app.conf.broker_url)
    _client.rpush(RUNS, str(self.request.id))
    return n


def _fold_task(unique_while: str) -> Any:
    """A task of :func:`_note` on the broker's database, named after its mode."""
    return single_execution(
        app=app,
        name=f"fold.{unique_while}",
        backend="broker-db",
        unique_while=unique_while,
        ignore_result=True,
        bind=True,
    )(_note)


queued = _fold_task("queued")
queued_or_running = _fold_task("queued_or_running")
keeps_result = single_execution(
    app=app, name="fold.keeps_result", backend="broker-db", unique_while="queued", bind=True
)(_note)


#: A queue no worker reads: what :func:`_enqueue_twice` queues stays there.
IDLE_QUEUE = "distlocks-tests-fold-idle"


def _enqueue_twice(self: Any, n: int) -> None:
    """Queues ``queued`` of ``n`` twice from inside a run (in a worker's pool process),
    on :data:`IDLE_QUEUE`: notes ``enqueued:<first id>:<second id>``."""
    first = queued.apply_async((n,), queue=IDLE_QUEUE).id
    again = queued.apply_async((n,), queue=IDLE_QUEUE).id
    global _client
    if _client is None:
        _client = redis.Redis.from_url(app.conf.broker_url)
    _client.rpush(RUNS, f"enqueued:{first}:{again}")


enqueues_twice = single_execution(
    app=app, name="fold.enqueues_twice", backend="broker-db", ignore_result=True, bind=True
)(_enqueue_twice)
