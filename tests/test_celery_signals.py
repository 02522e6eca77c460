"""The lock signals of a single-execution run: ``lock_acquired`` hears of the run lock
(not of the queue marker), ``lock_not_acquired`` of a run that found it busy, and a
receiver that fails gives the run lock back, so that no lock is left that nobody will
release, on every path that takes it (one attempt alone, or with the queue marker in
one round trip).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from distlocks import get_backend, lock
from distlocks.contrib.celery import single_execution
from distlocks.lease import Lease
from distlocks.signals import lock_acquired, lock_not_acquired
from tests.celery_app import app

pytestmark = pytest.mark.django_db

#: A queue no worker consumes: messages published there stay put.
IDLE_QUEUE = "distlocks-tests-signals"

ran: list[int] = []


def _body(n: int) -> int:
    ran.append(n)
    return n


plain = single_execution(app=app, name="signals.plain")(_body)
queued = single_execution(app=app, name="signals.queued", unique_while="queued")(_body)
unique = single_execution(app=app, name="signals.unique", unique_while="queued_or_running")(_body)


class Refused(Exception):
    """Raised by the failing receiver."""


@pytest.fixture
def heard() -> Iterator[list[tuple[str, Any]]]:
    got: list[tuple[str, Any]] = []

    def acquired(sender: Any, lease: Lease, waited: float, **kwargs: Any) -> None:
        assert waited >= 0
        got.append(("acquired", lease))

    def not_acquired(sender: Any, name: str, **kwargs: Any) -> None:
        got.append(("not_acquired", name))

    lock_acquired.connect(acquired, weak=False)
    lock_not_acquired.connect(not_acquired, weak=False)
    try:
        yield got
    finally:
        lock_acquired.disconnect(acquired)
        lock_not_acquired.disconnect(not_acquired)


@pytest.fixture
def failing_receiver() -> Iterator[None]:
    def refuse(sender: Any, lease: Lease, **kwargs: Any) -> None:
        raise Refused(lease.name)

    lock_acquired.connect(refuse, weak=False)
    try:
        yield
    finally:
        lock_acquired.disconnect(refuse)


def _n() -> int:
    return uuid.uuid4().int % 10**12


def _run_as_worker(task: Any, n: int) -> Any:
    """Publish ``task(n)`` (its marker taken) and run it under its id, not eagerly, as a
    worker does with the message (the result stored: a worker's run)."""
    sent = task.apply_async((n,), queue=IDLE_QUEUE)
    app.conf.task_store_eager_result = True
    try:
        return task.apply((n,), task_id=sent.id)
    finally:
        app.conf.task_store_eager_result = False


def test_lock_acquired_hears_of_the_run_lock_once_per_run(
    heard: list[tuple[str, Any]],
) -> None:
    n = _n()
    assert plain.apply((n,)).get() == n
    assert [(kind, lease.name) for kind, lease in heard] == [("acquired", plain.lock_name((n,)))]
    assert heard[0][1].fencing_token > 0


@pytest.mark.parametrize("task", [queued, unique], ids=["queued", "queued_or_running"])
def test_lock_acquired_hears_of_the_run_lock_not_the_marker(
    task: Any, heard: list[tuple[str, Any]], broker: redis.Redis
) -> None:
    n = _n()
    assert _run_as_worker(task, n).get() == n
    assert [(kind, lease.name) for kind, lease in heard] == [("acquired", task.lock_name((n,)))]


def test_lock_not_acquired_hears_of_a_run_that_found_the_lock_busy(
    heard: list[tuple[str, Any]],
) -> None:
    n = _n()
    name = plain.lock_name((n,))
    with lock(name, ttl=30, timeout=0):
        heard.clear()
        ran.clear()
        assert plain.apply((n,)).get() is None  # skipped
    assert ran == []
    assert ("not_acquired", name) in heard


def test_a_failing_receiver_gives_the_run_lock_back(failing_receiver: None) -> None:
    n = _n()
    ran.clear()
    with pytest.raises(Refused):
        plain.apply((n,)).get()
    assert ran == []
    assert get_backend("default").inspect(plain.lock_name((n,))) is None


@pytest.mark.parametrize("task", [queued, unique], ids=["queued", "queued_or_running"])
def test_a_failing_receiver_gives_the_run_lock_back_on_the_shared_round_trip(
    task: Any, failing_receiver: None, broker: redis.Redis
) -> None:
    """The run lock taken with the marker's call (one round trip) is given back too, and
    the marker is not left held by a run that never started."""
    n = _n()
    ran.clear()
    with pytest.raises(Refused):
        _run_as_worker(task, n).get()
    assert ran == []
    backend = get_backend("default")
    assert backend.inspect(task.lock_name((n,))) is None
    assert backend.inspect(task.lock_name((n,)) + ":queued") is None
