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
