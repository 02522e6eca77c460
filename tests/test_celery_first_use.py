"""A task published from several threads on its first use: Celery registers the task
class before it binds it to the app, so a thread can meet a task without a request
stack. Celery's own ``apply_async()`` needs none; ``single_execution``'s must not either."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from django.conf import settings

from distlocks.contrib.celery import SingleExecutionTask


def _app() -> Celery:
    app = Celery(f"first-use-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.broker_url = settings.CELERY_BROKER_URL
    app.conf.task_default_queue = f"first-use-{uuid.uuid4().hex[:8]}"
    app.conf.task_ignore_result = True
    return app


def _unbound_task(app: Celery, unique_while: str | None) -> Any:
    """The task as such a thread sees it: the class made and registered, not yet bound
    (``Task.bind`` is what gives it a request stack)."""

    def body(order: int) -> int:
        return order

    options: dict[str, Any] = {"key": "first-use:{order}", "backend": "redis"}
    if unique_while:
        options["unique_while"] = unique_while
    task_class = type(
        "FirstUse",
        (SingleExecutionTask,),
        {
            "_app": app,
            "name": f"first-use.{uuid.uuid4().hex[:8]}",
            "run": staticmethod(body),
            "single_execution": options,
            "__module__": __name__,
        },
    )
    task = task_class()
    assert task.request_stack is None  # the state the test is about
    return task


@pytest.mark.parametrize("unique_while", ["queued", "queued_or_running", None])
@pytest.mark.parametrize("task_id", [None, "given"])
def test_a_task_not_yet_bound_is_published(unique_while: str | None, task_id: str | None) -> None:
    app = _app()
    task = _unbound_task(app, unique_while)
    order = uuid.uuid4().int % 10**9
    given = f"{task_id}-{uuid.uuid4()}" if task_id else None
    result = task.apply_async((order,), task_id=given)
    assert result.id
    if given:
        assert result.id == given
    with app.connection_for_write() as connection:
        queued = connection.default_channel.client.llen(app.conf.task_default_queue)
    assert queued == 1
