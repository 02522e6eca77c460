"""The tasks of the Celery workloads: one trivial body, wrapped each way compared.

Every task takes the same single argument and does the same (almost) nothing,
so what differs between two rows is what the wrapping adds per task: the plain
``@app.task`` is the floor, and the others add a run lock, a queue marker or a
peer's enqueue-time marker. Task names start with ``bench.celery.`` so the keys
that name them (the peers' markers, distlocks' run locks) are recognisable.

The ``*_e2e`` tasks are run by a real worker in the end-to-end workload. Around
each of their runs, Celery's ``task_prerun``/``task_postrun`` signals note how long
the worker took to run it (wrapper included) and when it finished, on a Redis list
named in the arguments; the finish time is on the system-wide monotonic clock
(``time.monotonic_ns`` on Linux), which the publishing process shares.
"""

from __future__ import annotations

import time
from typing import Any

from celery.signals import task_postrun, task_prerun, worker_init
from celery_once import QueueOnce
from celery_singleton import Singleton

from bench.celery_app import app
from distlocks.contrib.celery import single_execution


def _trivial(n: int) -> int:
    return n


plain = app.task(name="bench.celery.plain")(_trivial)
single = single_execution(app=app, name="bench.celery.single")(_trivial)
single_queued = single_execution(app=app, name="bench.celery.single_queued", unique_while="queued")(
    _trivial
)
single_unique = single_execution(
    app=app, name="bench.celery.single_unique", unique_while="queued_or_running"
)(_trivial)
# Both peers mark a task when it is enqueued and clear the mark when it has run;
# neither takes a lock around the run. Duplicates are refused quietly, as distlocks' are.
once = app.task(name="bench.celery.once", base=QueueOnce, once={"graceful": True})(_trivial)
singleton = app.task(name="bench.celery.singleton", base=Singleton)(_trivial)


def _e2e_body(done_list: str, n: int) -> int:
    return n


plain_e2e = app.task(name="bench.celery.plain_e2e")(_e2e_body)
single_e2e = single_execution(app=app, name="bench.celery.single_e2e")(_e2e_body)
E2E_TASKS = frozenset({plain_e2e.name, single_e2e.name})

_client: Any = None
#: Task id -> when the worker started tracing it, in this worker process.
_started: dict[str, int] = {}


def _redis() -> Any:
    """One client per worker process, opened on first use (after the fork)."""
    global _client
    if _client is None:
        import redis

        from bench.settings import REDIS_URL

        _client = redis.Redis.from_url(REDIS_URL)
    return _client


def _note_start(sender: Any = None, task_id: str = "", **kwargs: Any) -> None:
    if sender is not None and sender.name in E2E_TASKS:
        _started[task_id] = time.monotonic_ns()


def _note_end(sender: Any = None, task_id: str = "", args: Any = (), **kwargs: Any) -> None:
    """Note ``n:run time:finish time`` on the task's list (one RPUSH, after the run)."""
    if sender is None or sender.name not in E2E_TASKS:
        return
    finished = time.monotonic_ns()
    started = _started.pop(task_id, finished)
    done_list, n = args
    _redis().rpush(done_list, f"{n}:{finished - started}:{finished}")


@worker_init.connect
def _time_runs(**kwargs: Any) -> None:
    """In the worker only: with no receiver, Celery's tracer skips these signals, so the
    in-process workloads (``task.apply()`` in the benchmark's process) never pay for them.

    Celery sends them just before and just after it calls the task (its ``__call__``,
    so the run lock is inside), in the pool process that runs it.
    """
    task_prerun.connect(_note_start, weak=False)
    task_postrun.connect(_note_end, weak=False)
