"""Defects found by review of single execution, each with the case that showed it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from distlocks.contrib.celery import single_execution
from tests.celery_app import app

pytestmark = pytest.mark.django_db


def test_a_retry_never_takes_over_an_earlier_attempt_still_running(name: str) -> None:
    """The retry message of a task that retried with throw=False (or caught its Retry)
    is delivered while the earlier attempt still runs the body: the retried attempt
    must not take the run lock over (only a lock parked for the retry is taken over)."""
    inside: list[int] = []
    overlaps: list[list[int]] = []
    first_started = threading.Event()
    release_first = threading.Event()
    key = f"{name}:{{x}}"

    @single_execution(app=app, bind=True, key=key, ttl=5, name=f"review.takeover.{name}")
    def task(self: Any, x: str) -> int:
        attempt = int(self.request.retries)
        inside.append(attempt)
        overlaps.append(sorted(inside))
        if attempt == 0:
            first_started.set()
            release_first.wait(10)
        inside.remove(attempt)
        return attempt

    task_id = f"review-takeover-{name}"
    results: dict[int, Any] = {}
    first = threading.Thread(
        target=lambda: results.__setitem__(0, task.apply(("k",), task_id=task_id))
    )
    first.start()
    try:
        assert first_started.wait(10)
        # What a worker does with the retry message (same id, retries=1) meanwhile.
        results[1] = task.apply(("k",), task_id=task_id, retries=1)
    finally:
        release_first.set()
        first.join(15)
    assert all(len(seen) == 1 for seen in overlaps), overlaps
    assert results[0].successful(), results[0].result
    # The retried attempt did not run alongside: it was retried again (eagerly here,
    # until its retries ran out: AlreadyRunning).
    assert results[1].state in ("RETRY", "FAILURE"), (results[1].state, results[1].result)


@pytest.mark.parametrize(
    "value",
    [(1, 2), ((1, 2), 3), {1: "a"}, {"k": (1, {2: (3,)})}, [1, 2], "plain", 7],
    ids=repr,
)
def test_a_key_template_is_the_same_on_both_ends(value: Any, name: str) -> None:
    """The publisher formats the key from Python values; the worker from what the JSON
    message gave it (tuples as lists, int dict keys as strings): the same name."""
    import json

    def by_template(x: Any) -> Any:
        return x

    def by_callable(x: Any) -> Any:
        return x

    prefix = f"review-{abs(hash(name))}"  # the test's name may hold braces
    templated = single_execution(app=app, key=prefix + ":{x}", name=f"{prefix}.t")(by_template)
    called = single_execution(app=app, key=lambda x: f"{prefix}:{x!r}", name=f"{prefix}.c")(
        by_callable
    )
    arrived = json.loads(json.dumps(value))
    assert templated.lock_name((value,)) == templated.lock_name((arrived,))
    assert called.lock_name((value,)) == called.lock_name((arrived,))


def test_long_task_names_sharing_a_beginning_do_not_share_a_lock(name: str) -> None:
    def one(x: Any) -> Any:
        return x

    def two(x: Any) -> Any:
        return x

    stem = "a" * 170
    first = single_execution(app=app, name=f"{stem}.one")(one)
    second = single_execution(app=app, name=f"{stem}.two")(two)
    assert first.lock_name((1,)) != second.lock_name((1,))
    assert len(first.lock_name((1,))) <= 200


def test_a_duplicate_of_an_eager_run_is_not_handed_its_unstored_id(name: str) -> None:
    """A run started by apply() (eager: no result stored) holds the key: a duplicate call
    is published, never answered with the eager run's id (PENDING for ever)."""
    started, finish = threading.Event(), threading.Event()

    @single_execution(
        app=app, key=f"{name}:{{x}}", unique_while="queued_or_running", ttl=10,
        name=f"review.eager.{name}",
    )  # fmt: skip
    def task(x: str) -> str:
        started.set()
        finish.wait(10)
        return x

    eager_id = f"review-eager-{name}"
    runner = threading.Thread(target=lambda: task.apply(("k",), task_id=eager_id))
    runner.start()
    try:
        assert started.wait(10)
        duplicate = task.apply_async(("k",))
        assert duplicate.id != eager_id
    finally:
        finish.set()
        runner.join(15)
