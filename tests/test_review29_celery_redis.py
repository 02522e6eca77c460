"""Review 29: the calls a single-execution task sends together on Redis
(:mod:`distlocks.contrib.celery_redis`) when the connection breaks after the server
ran them and before their replies came back.

The loss is real: a proxy between the backend and the test server (see
:mod:`tests.lost_reply_proxy`) forwards the pipelined request, swallows the server's
replies and resets the connection. What the server ran must be what the task
believes: a run lock it took is its lease (not a stranger's that makes the task a
duplicate of itself), releases it made are released (not reported lost).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings as django_settings

from distlocks import get_backend, lock, signals
from distlocks.backends.redis import RedisBackend
from distlocks.contrib import celery_redis
from distlocks.contrib.celery import single_execution
from distlocks.exceptions import LockBackendUnavailable
from tests.celery_app import app
from tests.celery_lossy import lossy_backend
from tests.lost_reply_proxy import LostReplyProxy

pytestmark = pytest.mark.django_db

ALIAS = "review29-lossy"


@pytest.fixture(scope="module")
def proxy(lost_reply_proxy: LostReplyProxy) -> LostReplyProxy:
    """The session's lost-reply proxy (tests/conftest.py)."""
    return lost_reply_proxy


@pytest.fixture
def lossy(proxy: LostReplyProxy, settings: Any) -> Iterator[RedisBackend]:
    """A backend alias whose connections go through the proxy."""
    for backend in lossy_backend(proxy, settings, ALIAS, "r29"):
        backend.client.script_load(celery_redis.ENQUEUE.script)  # (_sha loads the others)
        yield backend


def _sha(backend: RedisBackend, script: str) -> bytes:
    """The script's SHA-1, with the script in the server's cache (the request whose
    reply is lost is then the script's run, not one answered NOSCRIPT)."""
    registered = backend._scripts[script]
    registered.sha = backend.client.script_load(registered.script)
    assert backend.client.script_exists(registered.sha) == [True]
    return str(registered.sha).encode()


def test_both_releases_run_with_their_replies_lost_report_released(
    proxy: LostReplyProxy, lossy: RedisBackend
) -> None:
    """The run lock and the marker released in one round trip; the server ran both and
    the replies were lost: neither lease is reported lost, and both are free."""
    name = f"run-{uuid.uuid4().hex}"
    lease = lock(name, backend=ALIAS, ttl=30, auto_renew=False).acquire()
    marker = lock(name + ":queued", backend=ALIAS, ttl=30, auto_renew=False).acquire()
    before = proxy.lost
    proxy.lose_reply_to(_sha(lossy, "release"))
    assert celery_redis.release_both(lease, marker) is True
    assert proxy.lost == before + 1
    assert lease.state == "released"
    assert marker.state == "released"
    assert lossy.inspect(name) is None
    assert lossy.inspect(name + ":queued") is None


ran: list[int] = []


@single_execution(app=app, name="review29.queued", backend=ALIAS, unique_while="queued")
def queued_task(n: int) -> int:
    ran.append(n)
    return n


def test_a_run_lock_taken_with_its_reply_lost_is_the_runs_own(
    proxy: LostReplyProxy, lossy: RedisBackend
) -> None:
    """The first attempt at the run lock and the marker's release went in one script;
    the server ran it and the reply was lost. The lock the server granted is this
    run's: the body runs, and both keys are free afterwards (not a duplicate of
    itself, with the lock left held by an owner nobody renews or releases)."""
    n = uuid.uuid4().int % 10**12
    name = queued_task.lock_name((n,))
    sent = queued_task.apply_async((n,), queue=IDLE_QUEUE)
    assert lossy.inspect(name + ":queued") is not None
    script = celery_redis.RUN_START
    script.sha = str(lossy.client.script_load(script.script))
    before = proxy.lost
    proxy.lose_reply_to(script.sha.encode())
    app.conf.task_store_eager_result = True
    try:
        result = queued_task.apply((n,), task_id=sent.id)
    finally:
        app.conf.task_store_eager_result = False
    assert proxy.lost == before + 1
    assert result.get(propagate=True) == n
    assert ran.count(n) == 1
    assert lossy.inspect(name) is None
    assert lossy.inspect(name + ":queued") is None
    _drop_idle_queue()


flushed: list[int] = []


@single_execution(
    app=app, name="review29.qor", key="r29-qor:{n}", unique_while="queued_or_running"
)  # fmt: skip
def flushing_task(n: int) -> int:
    # The server forgets every script while the run holds both locks (SCRIPT FLUSH, a
    # failover to a replica that never ran them): the end's pipelined releases meet
    # NOSCRIPT for both calls.
    get_backend("default").client.script_flush()
    flushed.append(n)
    return n


def test_both_releases_after_a_script_flush_mid_run_free_both_keys() -> None:
    backend = get_backend("default")
    n = uuid.uuid4().int % 10**12
    released: list[str] = []

    def on_release(sender: Any, lease: Any, **_: Any) -> None:
        released.append(lease.name)

    signals.lock_released.connect(on_release)
    app.conf.task_store_eager_result = True
    try:
        sent_id = str(uuid.uuid4())
        assert flushing_task.apply((n,), task_id=sent_id).get() == n
    finally:
        app.conf.task_store_eager_result = False
        signals.lock_released.disconnect(on_release)
    assert flushed == [n]
    assert backend.inspect(f"r29-qor:{n}") is None
    assert backend.inspect(f"r29-qor:{n}:queued") is None
    assert sorted(released) == [f"r29-qor:{n}", f"r29-qor:{n}:queued"]


RESTART_ALIAS = "review29-own"
IDLE_QUEUE = "distlocks-tests-review29"


@single_execution(
    app=app, name="review29.restart", key="r29-restart:{n}", backend=RESTART_ALIAS,
    unique_while="queued_or_running",
)  # fmt: skip
def restarted_task(n: int) -> int:
    return n


def test_a_restart_without_persistence_between_enqueue_and_run(
    own_redis: Any, settings: Any
) -> None:
    """The lock server restarts empty (no persistence) while the message waits: the
    marker is gone and every connection and script with it. The run still runs once
    and frees both keys; the next call is published, not answered with a lost id."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        RESTART_ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": own_redis.url,
        },
    }
    backend = get_backend(RESTART_ALIAS)
    n = uuid.uuid4().int % 10**12
    sent = restarted_task.apply_async((n,), queue=IDLE_QUEUE)
    assert backend.inspect(f"r29-restart:{n}:queued") is not None
    port = own_redis.port
    own_redis.kill()
    own_redis.start(port=port)
    app.conf.task_store_eager_result = True
    try:
        assert restarted_task.apply((n,), task_id=sent.id).get() == n
    finally:
        app.conf.task_store_eager_result = False
    assert backend.inspect(f"r29-restart:{n}") is None
    assert backend.inspect(f"r29-restart:{n}:queued") is None
    again = restarted_task.apply_async((n,), queue=IDLE_QUEUE)
    assert again.id != sent.id
    info = backend.inspect(f"r29-restart:{n}:queued")
    assert info is not None and info.extra["celery_task_id"] == again.id
    backend.release_quietly(f"r29-restart:{n}:queued", info.owner)
    _drop_idle_queue()


def _drop_idle_queue() -> None:
    """The messages published to the queue no worker consumes."""
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    broker.delete(IDLE_QUEUE)
    broker.close()


def test_a_stalled_pipelined_release_raises_lock_backend_unavailable(
    proxy: LostReplyProxy, settings: Any
) -> None:
    """The server's replies to the releases sent together do not come back within the
    socket timeout (a network stall): the caller gets the backend's error, as a plain
    release would give it (LockBackendUnavailable, the driver's error chained), not a
    bare driver exception that no handler of lock errors catches."""
    db = int(urlsplit(django_settings.REDIS_URL).path.strip("/") or 0)
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": proxy.url(db),
            "OPTIONS": {"key_prefix": f"r29-{uuid.uuid4().hex[:8]}", "socket_timeout": 0.3},
        },
    }
    backend = get_backend(ALIAS)
    name = f"stall-{uuid.uuid4().hex}"
    lease = lock(name, backend=ALIAS, ttl=30, auto_renew=False).acquire()
    marker = lock(name + ":queued", backend=ALIAS, ttl=30, auto_renew=False).acquire()
    stalled = threading.Event()
    # The replies are held back past the socket timeout, then the connection is reset.
    proxy.lose_reply_to(_sha(backend, "release"), lambda: stalled.wait(1.5))
    with pytest.raises(LockBackendUnavailable) as raised:
        celery_redis.release_both(lease, marker)
    assert isinstance(raised.value.__cause__, redis.TimeoutError)
    stalled.set()
    # The server ran both: nothing is left held.
    assert backend.inspect(name) is None
    assert backend.inspect(name + ":queued") is None
