"""Review 6: single execution with ``unique_while`` on a Redis Cluster LOCATION (the run
lock and its marker in two slots, maybe on two nodes) and through Sentinel. There the
calls that go together on one server (the run start's one script, the enqueue check)
cannot: each is its own call. What a task does must not change: a duplicate enqueue is
answered with the queued task's id, the run lets its marker go (``"queued"``) or keeps
it to its end (``"queued_or_running"``), a call made while the task runs is answered as
its mode says, and both keys are free after the run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings

from distlocks import get_backend
from distlocks.backends.redis import RedisBackend
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from distlocks.testing.servers import RedisClusterSet, RedisSentinelSet
from tests.celery_app import app

pytestmark = pytest.mark.django_db

ALIAS = "review6-topology"
#: A queue no worker reads: the tests run the messages themselves, by apply().
IDLE_QUEUE = "distlocks-tests-review6-topology"


@pytest.fixture(scope="module")
def sentinel_set() -> Iterator[RedisSentinelSet]:
    sentinel = RedisSentinelSet(replicas=1, sentinels=3, quorum=2, down_after_ms=2000).start()
    yield sentinel
    sentinel.close()


@pytest.fixture(params=["cluster", "sentinel"])
def topology(request: pytest.FixtureRequest, settings: Any) -> Iterator[RedisBackend]:
    """The task's alias on a Redis Cluster, or through Sentinel."""
    if request.param == "cluster":
        location = request.getfixturevalue("redis_cluster").url
        assert isinstance(request.getfixturevalue("redis_cluster"), RedisClusterSet)
    else:
        location = request.getfixturevalue("sentinel_set").url
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": location},
    }
    backend = get_backend(ALIAS)
    assert isinstance(backend, RedisBackend) and not celery_redis.usable(backend)
    yield backend
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    broker.delete(IDLE_QUEUE)
    broker.close()


seen: dict[int, Any] = {}


def _body(n: int, mode: str) -> int:
    # A call made while this run holds its lock (the marker let go with "queued", kept
    # with "queued_or_running").
    task = tasks[mode]
    seen[n] = task.apply_async((n, mode), queue=IDLE_QUEUE).id
    return n


tasks = {
    mode: single_execution(app=app, name=f"review6.topology.{mode}", backend=ALIAS,
                           key="r6-topology:{n}", unique_while=mode)(_body)
    for mode in ("queued", "queued_or_running")
}  # fmt: skip


def _queue_twice_and_run(task: Any, backend: RedisBackend, n: int, mode: str) -> Any:
    """Queue the task of ``n`` twice (the second call is answered with the first's id),
    then run the queued message here; its AsyncResult."""
    first = task.apply_async((n, mode), queue=IDLE_QUEUE)
    held = backend.inspect(f"r6-topology:{n}:queued")
    assert held is not None and held.extra["celery_task_id"] == first.id
    assert task.apply_async((n, mode), queue=IDLE_QUEUE).id == first.id
    app.conf.task_store_eager_result = True
    try:
        assert task.apply((n, mode), task_id=first.id).get() == n
    finally:
        app.conf.task_store_eager_result = False
    return first


@pytest.mark.parametrize("mode", ["queued", "queued_or_running"])
def test_a_task_is_deduplicated_run_and_freed_as_on_one_server(
    mode: str, topology: RedisBackend
) -> None:
    task, backend = tasks[mode], topology
    n = uuid.uuid4().int % 10**12
    name, marker = f"r6-topology:{n}", f"r6-topology:{n}:queued"
    first = _queue_twice_and_run(task, backend, n, mode)
    if mode == "queued":
        # The marker was let go when the run started: the call made during the run
        # was queued, under a new id, and holds the marker now.
        assert seen[n] != first.id
        again = backend.inspect(marker)
        assert again is not None and again.extra["celery_task_id"] == seen[n]
        backend.release_quietly(marker, again.owner)
    else:
        # The run covered the key to its end: the call was answered with its id.
        assert seen[n] == first.id
    assert backend.inspect(name) is None
    assert backend.inspect(marker) is None
    assert task.apply_async((n, mode), queue=IDLE_QUEUE).id not in (first.id, seen[n])
    latest = backend.inspect(marker)
    assert latest is not None
    backend.release_quietly(marker, latest.owner)


@pytest.fixture(scope="module")
def one_node_cluster() -> Iterator[RedisClusterSet]:
    """A Redis Cluster of one primary, which serves every slot."""
    cluster = RedisClusterSet(masters=1, replicas=0).start()
    yield cluster
    cluster.close()


@pytest.mark.parametrize("mode", ["queued", "queued_or_running"])
def test_one_cluster_node_named_as_one_server_runs_the_task(
    mode: str, one_node_cluster: RedisClusterSet, settings: Any
) -> None:
    """A cluster of one node named as one server (``redis://``; with the listing index
    off, whose key is in a slot of its own, every lock call names keys of one slot and
    works). It refuses any call whose keys are in two slots, before running it: the
    calls that go together and name the run lock's and the marker's keys at once (the
    run start's script, the enqueue check with ``"queued_or_running"``) are made one
    by one instead, not failed."""
    node = one_node_cluster.nodes[0]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://127.0.0.1:{node.port}/0",
            "OPTIONS": {"listing_index": False},
        },
    }
    backend = get_backend(ALIAS)
    assert isinstance(backend, RedisBackend) and celery_redis.usable(backend)
    task = tasks[mode]
    n = uuid.uuid4().int % 10**12
    name, marker = f"r6-topology:{n}", f"r6-topology:{n}:queued"
    try:
        first = _queue_twice_and_run(task, backend, n, mode)
        assert (seen[n] == first.id) == (mode == "queued_or_running")
        assert backend.inspect(name) is None
    finally:
        info = backend.inspect(marker)
        if info is not None:
            backend.release_quietly(marker, info.owner)
        broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
        broker.delete(IDLE_QUEUE)
        broker.close()
