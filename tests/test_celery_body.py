"""How a single-execution task's body is entered: Celery's request, once.

Under Celery's tracer (a worker, ``task.apply()``) the task's request is on the stack
before ``__call__`` runs. A worker with its optimisations then calls the body straight
away; ``SingleExecutionTask`` does the same under the tracer without them, instead of
going through ``Task.__call__``, which would push a copy of the same request. These
tests pin what the body sees either way, and that every other way in (a direct call,
a call of the task from its own body, a class whose ``__call__`` comes between ours
and Celery's) still goes through Celery's ``__call__``. In-process (``apply()``), no
worker.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from celery import Task, current_task
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend
from distlocks.contrib.celery import SingleExecutionTask, current_lease, single_execution
from tests.celery_app import app

pytestmark = pytest.mark.django_db

seen: list[dict[str, Any]] = []


def _look(task: Any, n: int) -> dict[str, Any]:
    request = task.request
    return {
        "n": n,
        "depth": len(task.request_stack),
        "id": request.id,
        "args": list(request.args or ()),
        "called_directly": request.called_directly,
        "current_task": current_task._get_current_object() is task,
        "lease": current_lease(),
    }


@single_execution(app=app, name="body.look", key="body-look:{n}", bind=True)
def look(self: Any, n: int, inner: int | None = None) -> int:
    seen.append(_look(self, n))
    if inner is not None:
        # A call of the task from its own body, under another key: a run of its own,
        # with its own request (Celery's __call__ pushes it).
        look(inner)
    return n


class _Recording(Task):
    """A task class whose ``__call__`` has work of its own, after ours in the order."""

    calls: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _Recording.calls.append(args[0])
        return super().__call__(*args, **kwargs)


class _Mixed(SingleExecutionTask, _Recording):
    pass


@app.task(name="body.mixed", base=_Mixed, single_execution={"key": "body-mixed:{n}"}, bind=True)
def mixed(self: Any, n: int) -> int:
    seen.append(_look(self, n))
    return n


def _n() -> int:
    return uuid.uuid4().int % 10**12


def test_under_the_tracer_the_body_sees_the_request_once() -> None:
    """apply() (Celery's tracer, as a worker runs a task): one request on the stack,
    the tracer's, with the task's id and arguments, the task current, the lease set.
    (Two before: Task.__call__ pushed a copy of the same request.)"""
    seen.clear()
    n = _n()
    task_id = str(uuid.uuid4())
    assert look.apply((n,), task_id=task_id).get() == n
    [inside] = seen
    assert inside["depth"] == 1
    assert inside["id"] == task_id
    assert inside["args"] == [n]
    assert inside["called_directly"] is False
    assert inside["current_task"]
    assert inside["lease"] is not None and inside["lease"].name == f"body-look:{n}"
    assert get_backend("default").inspect(f"body-look:{n}") is None


def test_a_call_from_the_body_gets_a_request_of_its_own() -> None:
    """A call of the task from its own body (another key) runs with its own request
    pushed on top of the outer one, as Celery's __call__ does, and holds its own run
    lock; the outer request is the tracer's, once."""
    seen.clear()
    keys = [_n(), _n()]
    outer = look.apply((keys[0],), kwargs={"inner": keys[1]})
    assert outer.get() == keys[0]
    assert [s["n"] for s in seen] == [keys[0], keys[1]]
    first, second = seen
    assert first["depth"] == 1 and first["called_directly"] is False
    assert second["depth"] == 2
    assert second["args"] == [keys[1]]
    assert second["lease"] is not None and second["lease"].name == f"body-look:{keys[1]}"
    assert first["lease"].name == f"body-look:{keys[0]}"
    backend = get_backend("default")
    assert all(backend.inspect(f"body-look:{k}") is None for k in keys)


def test_a_direct_call_goes_through_celerys_call() -> None:
    seen.clear()
    n = _n()
    assert look(n) == n
    [inside] = seen
    assert inside["called_directly"] is True
    assert inside["args"] == [n]
    assert inside["lease"] is not None


def test_a_class_whose_call_comes_between_ours_and_celerys_keeps_it() -> None:
    """A ``__call__`` after SingleExecutionTask's in the method order has work of its
    own: it is called under the tracer too, never skipped."""
    seen.clear()
    _Recording.calls.clear()
    n = _n()
    assert mixed.apply((n,)).get() == n
    assert _Recording.calls == [n]
    [inside] = seen
    assert inside["lease"] is not None and inside["lease"].name == f"body-mixed:{n}"


_made = itertools.count()


def _shaped_body(self: Any, n: int) -> int:
    seen.append(_look(self, n))
    return n


def _mixin(records: bool, calls: list[str], label: str) -> type:
    """A Task subclass to mix in after SingleExecutionTask: with ``records``, a
    ``__call__`` of its own that notes the call and goes on (a class Celery's tracer
    must not skip); without, a class with no ``__call__``."""
    if not records:
        return type(f"Plain{label}", (Task,), {"abstract": True, "note": label})

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(label)
        return super(mixin, self).__call__(*args, **kwargs)

    mixin = type(f"Recording{label}", (Task,), {"abstract": True, "__call__": __call__})
    return mixin


@hsettings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=st.lists(st.booleans(), max_size=3), before=st.booleans())
def test_every_call_between_ours_and_celerys_runs_once_under_the_tracer(
    shape: list[bool], before: bool
) -> None:
    """Over task classes made of SingleExecutionTask and mixins (with a ``__call__``
    of their own or not, before ours or after it in the method order): under the
    tracer every ``__call__`` runs exactly once, the body sees its own arguments and
    its run lock, and one request is on the stack unless a ``__call__`` after ours
    pushed Celery's copy."""
    calls: list[str] = []
    after = [_mixin(records, calls, f"A{i}") for i, records in enumerate(shape)]
    bases: list[type] = [SingleExecutionTask, *after]
    if before:
        bases.insert(0, _mixin(True, calls, "B"))
    klass = type("Shaped", tuple(bases), {"abstract": True})
    number = next(_made)
    task = app.task(
        name=f"body.shaped.{number}",
        base=klass,
        single_execution={"key": f"body-shaped-{number}:{{n}}"},
        bind=True,
    )(_shaped_body)
    seen.clear()
    n = _n()
    assert task.apply((n,)).get() == n
    expected = (["B"] if before else []) + [f"A{i}" for i, r in enumerate(shape) if r]
    assert calls == expected
    [inside] = seen
    assert inside["args"] == [n]
    assert inside["lease"] is not None and inside["lease"].name == f"body-shaped-{number}:{n}"
    if not any(shape):
        assert inside["depth"] == 1
    assert get_backend("default").inspect(f"body-shaped-{number}:{n}") is None
