"""Celery single execution (distlocks.contrib.celery).

The first part runs tasks in this process (``task.apply()``, Celery's own local
execution, and ``apply_async()`` publishing to the real Redis broker with no worker
listening). The second part starts two real worker processes (prefork, concurrency
2) on the Redis broker; their tasks record each run in PostgreSQL, so overlaps,
duplicates and redeliveries are checked from the outside.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kombu.exceptions import OperationalError

from distlocks import get_backend, lock
from distlocks.contrib.celery import (
    AlreadyRunning,
    Deduplicated,
    SingleExecutionTask,
    current_lease,
    single_execution,
)
from distlocks.exceptions import LockLost, StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.locks import holder_extra
from tests import celery_tasks
from tests.celery_app import app
from tests.celery_workers import celery_workers
from tests.testapp import tasks
from tests.testapp.models import Counter, TaskRun
from tests.waiting import wait_for, wait_gone

ROOT = Path(__file__).resolve().parent.parent
#: A queue no worker consumes: messages published there stay put for inspection.
IDLE_QUEUE = "distlocks-tests-idle"


def _free(name: str, alias: str = "default") -> None:
    get_backend(alias).force_release(name)


# -- tasks run in this process only ---------------------------------------------------

calls: list[Any] = []


@single_execution(app=app, name="local.keyed")
def keyed(account: int, amount: Decimal = Decimal("1.50"), *, note: str = "") -> None:
    calls.append(("keyed", account))


@single_execution(app=app, name="local.templated", key="account:{account}")
def templated(account: int, amount: int = 0) -> None:
    calls.append(("templated", account))


@single_execution(app=app, name="local.by_callable", key=lambda account, **_: f"acct-{account}")
def by_callable(account: int, amount: int = 0) -> None:
    calls.append(("by_callable", account))


def _policy_task(policy: str, backend: str = "default") -> Any:
    @single_execution(
        app=app,
        name=f"local.policy.{policy}.{backend}",
        key="policy:{run}",
        backend=backend,
        on_duplicate=policy,
        retry_countdown=0.01,
        max_retries=2,
    )
    def body(run: str) -> str:
        calls.append(("policy", run))
        return "ran"

    return body


@single_execution(app=app, name="local.fenced", bind=True, key="testapp.counter:{pk}")
def fenced_increment(self: Any, pk: int) -> int:
    counter = Counter.objects.get(pk=pk)
    counter.value += 1
    counter.save()  # the token comes from the task's lease: its key is the row's lock name
    assert self.lease is current_lease()
    return current_lease().fencing_token  # type: ignore[union-attr]


inside = threading.Event()
resume = threading.Event()


@single_execution(app=app, name="local.paused", key="paused:{run}", ttl=5, bind=True)
def paused(self: Any, run: str) -> dict[str, Any]:
    backend = get_backend("default")
    info = backend.inspect(f"paused:{run}")
    inside.set()
    resume.wait(30)
    return {"holder_task_id": info.extra.get("celery_task_id") if info else None}


@single_execution(app=app, name="local.at_least", key="at-least:{run}", lock_at_least_for=30)
def at_least(run: str) -> None:
    calls.append(("at_least", run))


@single_execution(app=app, name="local.queued", unique_while="queued", unique_ttl=0.5)
def queued_once(item: int) -> None:
    calls.append(("queued", item))


@single_execution(
    app=app, name="local.queued_or_running", key="qor:{item}",
    unique_while="queued_or_running",
)  # fmt: skip
def queued_or_running(item: int) -> None:
    calls.append(("qor", item))


@single_execution(app=app, name="local.bad_template", key="x:{nope}")
def bad_template(account: int) -> None:
    calls.append(("bad_template", account))


def _nothing(n: int = 0) -> None:
    calls.append(("nothing", n))


# -- keys ---------------------------------------------------------------------------


def test_default_key_binds_arguments_to_the_signature() -> None:
    name = keyed.lock_name((7,), {})
    assert name.startswith("celery:local.keyed:")
    # Positional, keyword and defaulted arguments give the same key.
    assert keyed.lock_name((), {"account": 7}) == name
    assert keyed.lock_name((7, Decimal("1.50")), {"note": ""}) == name
    assert keyed.lock_name((7,), {"amount": Decimal("1.50")}) == name
    # Any difference in the bound arguments gives another key.
    assert keyed.lock_name((8,), {}) != name
    assert keyed.lock_name((7, Decimal("1.5")), {}) != name
    assert keyed.lock_name((7,), {"note": "x"}) != name


def test_default_key_survives_the_message_encoding() -> None:
    """Tuples and lists, dict order, and values the JSON serializer turns into
    strings give the key the worker computes from the decoded message."""
    day = dt.date(2026, 11, 21)
    sent = keyed.lock_name(((1, 2), {"b": 1, "a": [day, uuid.UUID(int=5)]}), {})
    received = keyed.lock_name(
        ([1, 2], {"a": [day.isoformat(), str(uuid.UUID(int=5))], "b": 1}), {}
    )
    assert sent == received


def test_template_and_callable_keys() -> None:
    assert templated.lock_name((42,), {"amount": 5}) == "account:42"
    assert templated.lock_name((), {"account": 42}) == "account:42"
    assert by_callable.lock_name((), {"account": 3, "amount": 9}) == "acct-3"


def test_arguments_that_cannot_make_a_key_fail_at_the_call(broker: redis.Redis) -> None:
    with pytest.raises(TypeError, match=r"Argument account .*cannot be turned into a lock key"):
        keyed.apply_async((object(),), queue=IDLE_QUEUE)
    with pytest.raises(TypeError, match="cannot take these arguments"):
        keyed.apply_async((1, 2, 3), queue=IDLE_QUEUE)
    with pytest.raises(ValueError, match="does not fit its arguments"):
        bad_template.apply_async((1,), queue=IDLE_QUEUE)
    assert broker.llen(IDLE_QUEUE) == 0  # nothing was published


def test_bad_options_are_refused_when_the_task_is_defined() -> None:
    with pytest.raises(ValueError, match="on_duplicate must be one of"):
        single_execution(on_duplicate="ignore")
    with pytest.raises(ValueError, match="unique_while must be None"):
        single_execution(unique_while="always")
    with pytest.raises(ValueError, match="ttl must be > 0"):
        single_execution(ttl=0)
    with pytest.raises(TypeError, match=r"key must be a str\.format template"):
        single_execution(key=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="subclass of SingleExecutionTask"):
        single_execution(base=object)
    with pytest.raises(TypeError, match=r"in place of @app\.task"):
        single_execution(app=app)(app.task(name="local.plain")(_nothing))
    with pytest.raises(TypeError, match="Unknown single_execution option"):
        type("Bad", (SingleExecutionTask,), {"single_execution": {"tll": 5}})


@pytest.mark.django_db
@override_settings(
    DISTLOCKS_BACKENDS={
        **settings.DISTLOCKS_BACKENDS,
        "default": settings.DISTLOCKS_BACKENDS["pg"],
    }
)
def test_options_needing_server_expiry_refuse_a_postgres_backend() -> None:
    with pytest.raises(ImproperlyConfigured, match="expire on the server"):
        queued_once.apply_async((1,))
    with pytest.raises(ImproperlyConfigured, match="expire on the server"):
        at_least.apply(("x",), throw=True)


# -- running ------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["default", pytest.param("pg", marks=pytest.mark.django_db)])
def test_duplicates_are_skipped_raised_or_retried(alias: str, request: Any) -> None:
    if alias == "pg":
        request.getfixturevalue("pg_ready")
    run = uuid.uuid4().hex
    calls.clear()
    skip, fail, retry = (_policy_task(p, alias) for p in ("skip", "raise", "retry"))
    with lock(f"policy:{run}", backend=alias, ttl=30, timeout=0):
        assert skip.apply((run,)).get() is None
        result = fail.apply((run,))
        assert isinstance(result.result, AlreadyRunning)
        assert f"policy:{run}" in str(result.result)
        result = retry.apply((run,))  # retried twice (eagerly), then gives up
        assert isinstance(result.result, AlreadyRunning)
        assert result.state == "FAILURE"
    assert calls == []  # no body ran while the lock was held
    assert skip.apply((run,)).get() == "ran"
    assert calls == [("policy", run)]


@pytest.mark.django_db
@pytest.mark.usefixtures("pg_ready")
def test_the_task_reaches_its_lease_for_fenced_saves() -> None:
    with unfenced():
        counter = Counter.objects.create(value=0)
    first = fenced_increment.apply((counter.pk,)).get()
    second = fenced_increment.apply((counter.pk,)).get()
    counter.refresh_from_db()
    assert counter.value == 2
    assert second > first
    assert counter.fencing_token == second
    assert current_lease() is None  # outside a task


def test_holder_records_the_task_id_and_a_lost_lease_fails_the_task() -> None:
    run = uuid.uuid4().hex
    inside.clear()
    resume.clear()
    outcome: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: outcome.update(result=paused.apply((run,), task_id="task-123"))
    )
    thread.start()
    try:
        assert inside.wait(30)
        assert get_backend("default").force_release(f"paused:{run}")
    finally:
        resume.set()
        thread.join(30)
    result = outcome["result"]
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockLost)
    assert holder_extra.get() == {}  # the task's metadata did not leak out


@single_execution(app=app, name="local.eager_retry", key="eager-retry:{run}", bind=True)
def eager_retry(self: Any, run: str) -> int:
    calls.append(("eager_retry", self.request.retries))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return current_lease().fencing_token  # type: ignore[union-attr]


def test_an_eager_retry_takes_the_lock_again() -> None:
    calls.clear()
    run = uuid.uuid4().hex
    result = eager_retry.apply((run,))
    if result.state == "RETRY":  # Celery < 5.5: apply() does not run the retry itself
        assert calls == [("eager_retry", 0)]
    else:  # the retry ran after the first run ended: it was not skipped as a duplicate
        assert result.state == "SUCCESS", result.traceback
        assert calls == [("eager_retry", 0), ("eager_retry", 1)]
        assert isinstance(result.result, int)
    assert get_backend("default").inspect(f"eager-retry:{run}") is None


@single_execution(app=app, name="local.recursive", key="recursive", bind=True)
def recursive(self: Any, depth: int) -> int:
    """Calls itself in-process; same key, so the inner call must not wait for the outer."""
    calls.append(("recursive", depth))
    if depth:
        return recursive.apply((depth - 1,), throw=True).get()
    return current_lease().fencing_token  # type: ignore[union-attr]


def test_a_task_calling_itself_in_process_reenters_its_lock() -> None:
    calls.clear()
    assert isinstance(recursive.apply((2,), throw=True).get(), int)
    assert calls == [("recursive", 2), ("recursive", 1), ("recursive", 0)]


def test_lock_at_least_for_keeps_the_lock_after_a_short_run() -> None:
    run = uuid.uuid4().hex
    calls.clear()
    try:
        at_least.apply((run,)).get()
        info = get_backend("default").inspect(f"at-least:{run}")
        assert info is not None, "the lock was freed when the run ended"
        assert 20 < info.expires_in.total_seconds() <= 30
        assert at_least.apply((run,)).get() is None  # a late node skips it
        assert calls == [("at_least", run)]
    finally:
        _free(f"at-least:{run}")


def test_a_duplicate_enqueue_returns_the_queued_task(broker: redis.Redis) -> None:
    item = int(time.time_ns() % 1_000_000)
    first = queued_once.apply_async((item,), countdown=5, queue=IDLE_QUEUE)
    again = queued_once.apply_async((item,), queue=IDLE_QUEUE)
    other = queued_once.apply_async((item + 1,), queue=IDLE_QUEUE)
    assert again.id == first.id
    assert other.id != first.id
    assert broker.llen(IDLE_QUEUE) == 2
    # The marker covers the countdown, although unique_ttl is only 0.5 s.
    marker = get_backend("default").inspect(queued_once.lock_name((item,)) + ":queued")
    assert marker is not None
    assert marker.extra["celery_task_id"] == first.id
    assert marker.expires_in.total_seconds() > 4.5
    # An eta is covered the same way.
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=8)
    later = queued_once.apply_async((item + 2,), eta=eta, queue=IDLE_QUEUE)
    marker = get_backend("default").inspect(queued_once.lock_name((item + 2,)) + ":queued")
    assert marker is not None and marker.extra["celery_task_id"] == later.id
    assert marker.expires_in.total_seconds() > 7.5


def test_queued_or_running_returns_the_running_task(broker: redis.Redis) -> None:
    item = int(time.time_ns() % 1_000_000)
    token = holder_extra.set({"celery_task_id": "running-task"})
    try:
        with lock(f"qor:{item}", ttl=30, timeout=0):
            assert queued_or_running.apply_async((item,), queue=IDLE_QUEUE).id == "running-task"
    finally:
        holder_extra.reset(token)
    assert broker.llen(IDLE_QUEUE) == 0
    assert get_backend("default").inspect(f"qor:{item}:queued") is None
    # Nothing runs now: it is queued.
    queued = queued_or_running.apply_async((item,), queue=IDLE_QUEUE)
    assert broker.llen(IDLE_QUEUE) == 1
    assert queued_or_running.apply_async((item,), queue=IDLE_QUEUE).id == queued.id


def test_a_failed_publish_leaves_no_marker() -> None:
    dead = Celery("dead-broker", broker="redis://127.0.0.1:9/0", set_as_current=False)
    dead.conf.broker_connection_timeout = 0.5
    task = single_execution(app=dead, name="local.dead", unique_while="queued")(_nothing)
    with pytest.raises(OperationalError, match=r"(?i)refused|connect"):
        task.apply_async((1,), retry=False)
    assert get_backend("default").inspect(task.lock_name((1,)) + ":queued") is None


# -- real workers on the Redis broker -----------------------------------------------


@pytest.fixture(scope="module")
def workers(pg_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Two worker processes, prefork with concurrency 2 each."""
    app.control.purge()
    logs = tmp_path_factory.mktemp("celery")
    two = [(f"w{index}", ["--concurrency", "2"]) for index in (1, 2)]
    with celery_workers(app, "tests.celery_app", logs, two) as pids:
        yield pids


def _rows(run: str) -> list[TaskRun]:
    return list(TaskRun.objects.filter(run=run).order_by("started"))


def _max_overlap(rows: list[TaskRun]) -> int:
    """The largest number of runs in progress at one moment."""
    events = sorted([(r.started, 1) for r in rows] + [(r.ended, -1) for r in rows])
    depth = peak = 0
    for _moment, step in events:
        depth += step
        peak = max(peak, depth)
    return peak


def _gate(client: redis.Redis, name: str) -> None:
    client.rpush(name, "go")
    client.expire(name, 60)


@pytest.mark.django_db
@pytest.mark.slow
def test_duplicate_enqueues_never_run_concurrently(workers: list[int]) -> None:
    run, control = uuid.uuid4().hex, uuid.uuid4().hex
    for _ in range(50):
        tasks.unguarded.delay(control, 0.05)
        tasks.serialized.delay(run, 0.02)

    def finished(key: str) -> bool:
        return TaskRun.objects.filter(run=key, ended__isnull=False).count() == 50

    wait_for(lambda: finished(control), limit=120, what="50 unguarded runs")
    wait_for(lambda: finished(run), limit=120, what="50 serialized runs")
    # The control shows the workers really run these tasks side by side...
    assert _max_overlap(_rows(control)) >= 2
    # ...and the run lock puts the 50 duplicates one after another.
    rows = _rows(run)
    assert _max_overlap(rows) == 1
    assert all(a.ended <= b.started for a, b in itertools.pairwise(rows))
    tokens = [r.fencing_token for r in rows]
    assert tokens == sorted(tokens) and len(set(tokens)) == 50
    assert len({r.pid for r in rows}) >= 2  # runs were spread over processes


@pytest.mark.django_db
@pytest.mark.slow
def test_duplicates_that_find_the_lock_taken_are_skipped(workers: list[int]) -> None:
    run = uuid.uuid4().hex
    results = [tasks.skipped.delay(run, 0.3) for _ in range(20)]
    for result in results:
        result.get(timeout=60)  # none failed; the skipped ones returned None
    rows = _rows(run)
    assert 1 <= len(rows) < 20
    assert _max_overlap(rows) == 1


@pytest.mark.django_db
@pytest.mark.slow
def test_enqueue_time_deduplication_runs_exactly_one(
    workers: list[int], redis_client: redis.Redis
) -> None:
    run, gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
    results = [tasks.deduplicated.delay(run, gate) for _ in range(50)]
    assert len({r.id for r in results}) == 1
    wait_for(lambda: _rows(run), limit=60, what="the deduplicated task to start")
    # While it runs, a duplicate still returns the running task.
    assert tasks.deduplicated.delay(run, gate).id == results[0].id
    _gate(redis_client, gate)
    results[0].get(timeout=60)
    rows = _rows(run)
    assert len(rows) == 1 and rows[0].ended is not None
    assert rows[0].task_id == results[0].id
    # Once it has finished, the same call is queued (and runs) again.
    again = tasks.deduplicated.delay(run, gate)
    assert again.id != results[0].id
    _gate(redis_client, gate)
    again.get(timeout=60)
    assert len(_rows(run)) == 2


@pytest.mark.django_db
@pytest.mark.slow
def test_a_worker_killed_mid_task_frees_the_lock_and_the_redelivery_runs_once(
    workers: list[int], redis_client: redis.Redis
) -> None:
    run, gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
    result = tasks.crash_prone.delay(run, gate)
    wait_for(lambda: _rows(run), limit=60, what="the task to start")
    (first,) = _rows(run)
    os.kill(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_gone([first.pid]) == []
    # acks_late + reject_on_worker_lost: the message comes back with the same id. Its
    # run waits for the dead process's lease (ttl 2 s) instead of skipping or overlapping.
    wait_for(lambda: len(_rows(run)) == 2, limit=60, what="the redelivered run")
    second = _rows(run)[1]
    print(f"lock freed and redelivery started {second.started - killed_at:.2f}s after SIGKILL")
    assert second.task_id == first.task_id == result.id
    assert second.started > killed_at
    assert second.started - killed_at < 2 + 10  # within the ttl, with room for a loaded CI
    assert second.fencing_token > first.fencing_token
    _gate(redis_client, gate)
    result.get(timeout=60)
    rows = _rows(run)
    assert [r.ended is not None for r in rows] == [False, True]  # ran to the end once


@pytest.mark.django_db
@pytest.mark.slow
def test_self_retry_neither_deadlocks_nor_overlaps(
    workers: list[int], redis_client: redis.Redis
) -> None:
    run = uuid.uuid4().hex
    result = tasks.retried.delay(run)
    assert result.get(timeout=60) is None
    rows = _rows(run)
    assert [r.attempt for r in rows] == [0, 1]
    assert {r.task_id for r in rows} == {result.id}
    assert rows[0].ended <= rows[1].started
    # The retry re-took the queue marker under its own id: nothing is left behind.
    backend = get_backend("default")
    name = tasks.retried.lock_name((run,))
    assert backend.inspect(name) is None
    assert backend.inspect(name + ":queued") is None


@pytest.mark.django_db
@pytest.mark.slow
def test_a_hard_time_limit_frees_the_lock_within_its_ttl(workers: list[int]) -> None:
    run = uuid.uuid4().hex
    blocked = tasks.time_limited.delay(run, True)
    blocked.get(timeout=60, propagate=False)
    assert blocked.state == "FAILURE"  # TimeLimitExceeded: the worker killed the process
    failed_at = time.monotonic()
    backend = get_backend("default")
    waited = wait_for(
        lambda: backend.inspect(f"limited:{run}") is None, limit=15, what="the lock to expire"
    )
    print(f"lock expired {waited:.2f}s after the hard time limit (ttl 2s)")
    assert time.monotonic() - failed_at < 2 + 10
    assert tasks.time_limited.delay(run, False).get(timeout=60) is None
    rows = _rows(run)
    assert [r.ended is not None for r in rows] == [False, True]
    assert rows[1].fencing_token > rows[0].fencing_token


# -- issue 25: bursts, canvas, redelivery, retries, claims ---------------------------


def _burst(call: Any, count: int = 20) -> list[Any]:
    """``count`` threads make ``call()`` at the same moment; their results."""
    barrier = threading.Barrier(count)
    out: list[Any] = [None] * count

    def one(index: int) -> None:
        barrier.wait(30)
        out[index] = call()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(result is not None for result in out)
    return out


def _published_ids(client: redis.Redis, queue: str) -> list[str]:
    import json

    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)]


def test_a_burst_while_a_copy_runs_is_given_the_running_id(broker: redis.Redis) -> None:
    """Issue 25.1 without a worker: 20 concurrent calls while a copy runs all get the
    running copy's id, and nothing is published."""
    item = int(time.time_ns() % 1_000_000)
    token = holder_extra.set({"celery_task_id": "the-running-copy"})
    try:
        with lock(f"qor:{item}", ttl=30, timeout=0):
            ids = _burst(lambda: queued_or_running.apply_async((item,), queue=IDLE_QUEUE).id)
    finally:
        holder_extra.reset(token)
    assert set(ids) == {"the-running-copy"}
    assert broker.llen(IDLE_QUEUE) == 0
    assert get_backend("default").inspect(f"qor:{item}:queued") is None


def test_a_burst_with_nothing_queued_publishes_one_message(broker: redis.Redis) -> None:
    item = int(time.time_ns() % 1_000_000)
    ids = _burst(lambda: queued_or_running.apply_async((item,), queue=IDLE_QUEUE).id)
    # Every caller holds the id of the one message that was published.
    assert _published_ids(broker, IDLE_QUEUE) == [ids[0]]
    assert set(ids) == {ids[0]}
    _free(f"qor:{item}:queued")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_infinite_argument_is_a_value_error(value: float) -> None:
    """docs/celery.md says so: a NaN is a bad value (ValueError), an object a bad type."""
    with pytest.raises(ValueError, match="cannot be a key"):
        keyed.lock_name((value,))
    doc = (ROOT / "docs" / "celery.md").read_text()
    assert "`NaN` or an infinity raises `ValueError`" in doc


@single_execution(
    app=app, name="local.claimed", bind=True, key="claimed:{pk}",
    claim=lambda pk, **_: Counter.objects.filter(pk=pk),
)  # fmt: skip
def claimed(self: Any, pk: int) -> tuple[int, int]:
    # Read after the claim: the row already carries this run's token.
    return Counter.objects.get(pk=pk).fencing_token, self.lease.fencing_token


@pytest.mark.django_db
@pytest.mark.usefixtures("pg_ready")
def test_claim_writes_the_run_locks_token_before_the_body() -> None:
    with unfenced():
        counter = Counter.objects.create(value=0)
    stored, token = claimed.apply((counter.pk,), throw=True).get()
    assert stored == token
    # A newer holder has written the row since (tokens grow with time: far ahead): the
    # claim refuses, the body never runs, the task fails and the run lock is released.
    Counter.objects.filter(pk=counter.pk).fenced_update(token + 10**12, value=1)
    result = claimed.apply((counter.pk,))
    counter.refresh_from_db()
    assert result.state == "FAILURE", (result.result, counter.fencing_token, token)
    assert isinstance(result.result, StaleFencingToken), result.result
    assert get_backend("default").inspect(f"claimed:{counter.pk}") is None


def test_claim_must_be_callable() -> None:
    with pytest.raises(TypeError, match="claim must be a callable"):
        single_execution(claim="rows")  # type: ignore[arg-type]


@pytest.mark.django_db
@pytest.mark.slow
def test_a_burst_while_a_copy_runs_on_a_worker_is_given_its_id(
    workers: list[int], redis_client: redis.Redis
) -> None:
    """Issue 25.1 with real workers: every caller of the burst gets the running copy's
    id, and that copy's result is what each of them finally reads."""
    run, gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
    first = celery_tasks.burst.delay(run, gate)
    wait_for(lambda: _rows(run), limit=60, what="the first copy to start")
    ids = _burst(lambda: celery_tasks.burst.delay(run, gate).id)
    assert set(ids) == {first.id}
    _gate(redis_client, gate)
    assert first.get(timeout=60) == f"ran:{first.id}"
    assert [r.task_id for r in _rows(run)] == [first.id]  # one run, nothing else queued


@pytest.mark.django_db
@pytest.mark.slow
def test_a_deduplicated_call_never_leaves_its_canvas_waiting(
    workers: list[int], redis_client: redis.Redis
) -> None:
    """Issue 25.2: a chain, link, link_error, group or chord whose deduplicated task
    was not queued fails at once with Deduplicated naming the copy; nothing stays
    PENDING, the errback runs and nothing after the deduplicated task runs."""
    from celery import chain, chord, group

    run, gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
    after, errors = f"{run}-after", f"{run}-errors"
    head = celery_tasks.canvas_head
    first = head.delay(run, gate)
    wait_for(lambda: _rows(run), limit=60, what="the first copy to start")
    try:
        chained = chain(head.s(run, gate), celery_tasks.record.s(after)).apply_async()
        linked = head.apply_async(
            (run, gate),
            link=celery_tasks.record.s(after),
            link_error=celery_tasks.record_error.s(errors),
        )
        grouped = group(head.s(run, gate), celery_tasks.record.si("g", after)).apply_async()
        chorded = chord(
            [head.s(run, gate), celery_tasks.record.si("c", after)], celery_tasks.collect.s()
        ).apply_async()
        outcomes = {
            "chain": chained.get(timeout=30, propagate=False) and chained,
            "chain head": chained.parent,
            "link": linked,
            "group member": grouped.results[0],
            "chord": chorded,
        }
        for what, result in outcomes.items():
            result.get(timeout=30, propagate=False)
            assert result.state == "FAILURE", f"{what}: {result.state}"
        for what in ("chain head", "link", "group member"):
            exc = outcomes[what].result
            assert isinstance(exc, Deduplicated), f"{what}: {exc!r}"
            assert exc.holder_task_id == first.id
            assert first.id in str(exc)
        assert first.id in str(chorded.result)  # a ChordError naming the cause
        assert grouped.results[1].get(timeout=30) == "g"  # the rest of the group ran
        wait_for(lambda: TaskRun.objects.filter(run=errors).exists(), limit=30, what="link_error")
        assert [r.task_id for r in TaskRun.objects.filter(run=errors)] == [linked.id]
    finally:
        _gate(redis_client, gate)
    assert first.get(timeout=60) == "head"
    # Only the group's and chord's own plain members ran "after"; no callback of a
    # deduplicated call did.
    assert sorted(r.task_id for r in _rows(after)) == sorted(
        [grouped.results[1].id, chorded.parent.results[1].id]
    )
    assert [r.task_id for r in _rows(run)] == [first.id]


def _active(task_id: str) -> int:
    """How many deliveries of ``task_id`` the workers are running."""
    found = app.control.inspect(timeout=1.0).active() or {}
    return sum(1 for tasks_ in found.values() for t in tasks_ if t["id"] == task_id)


@pytest.mark.django_db
@pytest.mark.slow
def test_a_redelivery_of_the_running_id_writes_no_state(
    workers: list[int], redis_client: redis.Redis
) -> None:
    """Issue 25.3: the same message delivered again while its first delivery runs (as
    after the visibility timeout) is ignored, and the real run's result is stored."""
    run, gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
    task_id = str(uuid.uuid4())
    result = celery_tasks.redelivered.apply_async((run, gate), task_id=task_id)
    wait_for(lambda: _rows(run), limit=60, what="the first delivery to start")
    celery_tasks.redelivered.apply_async((run, gate), task_id=task_id)
    try:
        # The second delivery waits for the lease (ttl 5 s) of the first, still alive.
        wait_for(lambda: _active(task_id) == 2, limit=60, what="the second delivery")
        wait_for(lambda: _active(task_id) == 1, limit=60, what="the second delivery to end")
        assert result.state in ("PENDING", "STARTED"), result.state  # no state written
    finally:
        _gate(redis_client, gate)
    assert result.get(timeout=60) == "the real result"
    assert [r.task_id for r in _rows(run)] == [task_id]


@pytest.mark.django_db
@pytest.mark.slow
def test_a_retry_is_never_lost_to_a_copy(workers: list[int], redis_client: redis.Redis) -> None:
    """Issue 25.4: during a retry's countdown the run lock stays claimed by the
    retrying task, so a copy enqueued meanwhile is the duplicate, and the retry runs."""
    run, gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
    task = celery_tasks.retry_once
    name = task.lock_name((run, gate, 3.0))
    result = task.delay(run, gate, 3.0)
    # RETRY is stored once the first attempt's run is over (its lock settled).
    wait_for(lambda: result.state == "RETRY", limit=60, what="the first attempt to retry")
    info = get_backend("default").inspect(name)
    assert info is not None, "the run lock was free during the retry's countdown"
    assert info.extra["celery_task_id"] == result.id
    copy = task.delay(run, gate, 3.0)
    try:
        assert copy.get(timeout=60) is None  # the copy was the duplicate (skipped)
        wait_for(lambda: len(_rows(run)) == 2, limit=60, what="the retried attempt")
    finally:
        _gate(redis_client, gate)
    assert result.get(timeout=60) == "done:1"
    rows = _rows(run)
    assert [(r.task_id, r.attempt) for r in rows] == [(result.id, 0), (result.id, 1)]
    assert rows[1].fencing_token > rows[0].fencing_token
    assert get_backend("default").inspect(name) is None


# -- a model of the rules, driven against real workers --------------------------------


class SingleExecutionMachine(RuleBasedStateMachine):
    """Enqueues (with retries and countdowns), duplicates, worker kills and finishes
    of one key, against a model: every call made while a copy is queued or running
    gets that copy's id, a new call after it finished gets a new one, runs of the key
    never overlap, and every id ends SUCCESS with the result of its last attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.run, self.gate = uuid.uuid4().hex, f"gate:{uuid.uuid4().hex}"
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.active: str | None = None
        self.retries: dict[str, int] = {}  # id -> retries its call asked for
        self.kills: dict[str, int] = {}
        self.killed: dict[int, float] = {}  # pid -> when it was killed (monotonic)

    def _current(self) -> TaskRun:
        """The active task's run in progress at its last attempt (waited for)."""
        assert self.active is not None
        last = self.retries[self.active]

        def found() -> TaskRun | None:
            return (
                TaskRun.objects.filter(
                    run=self.run, task_id=self.active, attempt=last, ended__isnull=True
                )
                .exclude(pid__in=list(self.killed))
                .first()
            )

        wait_for(found, limit=60, what="the active task's run")
        row = found()
        assert row is not None
        return row

    @rule(retries=st.integers(0, 1), countdown=st.sampled_from([None, 0.5]))
    def enqueue(self, retries: int, countdown: float | None) -> None:
        result = celery_tasks.modelled.apply_async(
            (self.run, self.gate, retries), countdown=countdown
        )
        if self.active is not None:
            assert result.id == self.active, "a duplicate got another id than the copy's"
        else:
            assert result.id not in self.retries, "a finished task's id was given again"
            self.active = result.id
            self.retries[result.id] = retries

    @rule(size=st.integers(2, 8))
    def burst(self, size: int) -> None:
        """Concurrent calls: all get one id, the copy's (or one new copy's)."""
        ids = set(_burst(lambda: celery_tasks.modelled.delay(self.run, self.gate, 0).id, size))
        assert len(ids) == 1, ids
        (task_id,) = ids
        if self.active is not None:
            assert task_id == self.active, "a duplicate got another id than the copy's"
        else:
            assert task_id not in self.retries, "a finished task's id was given again"
            self.active = task_id
            self.retries[task_id] = 0

    @precondition(lambda self: self.active is not None)
    @rule()
    def kill_its_worker(self) -> None:
        row = self._current()
        os.kill(row.pid, signal.SIGKILL)
        self.killed[row.pid] = time.monotonic()
        assert wait_gone([row.pid]) == []
        assert self.active is not None
        self.kills[self.active] = self.kills.get(self.active, 0) + 1
        # acks_late + reject_on_worker_lost: the same message runs again once the
        # dead process's lease has run out.
        self._current()

    @precondition(lambda self: self.active is not None)
    @rule()
    def finish(self) -> None:
        self._current()
        _gate(self.client, self.gate)
        task_id, self.active = self.active, None
        assert task_id is not None
        value = celery_tasks.modelled.AsyncResult(task_id).get(timeout=60)
        assert value == f"done:{task_id}:{self.retries[task_id]}"

    def teardown(self) -> None:
        try:
            if self.active is not None:
                self.finish()
            self._check()
        finally:
            self.client.close()

    def _check(self) -> None:
        rows = _rows(self.run)
        for task_id, retries in self.retries.items():
            result = celery_tasks.modelled.AsyncResult(task_id)
            assert result.state == "SUCCESS", (task_id, result.state)
            mine = [r for r in rows if r.task_id == task_id]
            # Every attempt ran; the last one ran to its end exactly once, plus one
            # unfinished run per kill.
            assert {r.attempt for r in mine} == set(range(retries + 1))
            assert sum(1 for r in mine if r.attempt == retries and r.ended) == 1
            assert sum(1 for r in mine if r.ended is None) == self.kills.get(task_id, 0)
        assert {r.task_id for r in rows} <= set(self.retries)  # no run of an unknown id
        # At most one run of the key at a time (a killed run ends when it was killed).
        ends = [(r.started, r.ended or self.killed[r.pid]) for r in rows]
        ends.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends)), ends


@pytest.mark.django_db
@pytest.mark.slow
def test_single_execution_against_a_model_of_its_rules(workers: list[int]) -> None:
    run_state_machine_as_test(
        SingleExecutionMachine,
        settings=hsettings(
            max_examples=3,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )


def test_a_retried_attempt_that_finds_a_copy_is_never_skipped() -> None:
    """Issue 25.4, the late case: the retry's kept lock ran out and a copy holds the
    key. With on_duplicate="skip" the retried attempt must not end SUCCESS/None (its
    work was never done): it retries, and fails with the reason when retries run out."""
    run = uuid.uuid4().hex
    calls.clear()
    skip = _policy_task("skip")
    token = holder_extra.set({"celery_task_id": "a-copy", "celery_attempt": "0"})
    try:
        with lock(f"policy:{run}", ttl=30, timeout=0):
            fresh = skip.apply((run,))
            retried = skip.apply((run,), retries=1)
    finally:
        holder_extra.reset(token)
    assert fresh.state == "SUCCESS" and fresh.result is None  # a fresh copy is skipped
    assert retried.state == "FAILURE", retried.state
    assert isinstance(retried.result, AlreadyRunning)
    assert retried.result.holder_task_id == "a-copy"
    assert calls == []
