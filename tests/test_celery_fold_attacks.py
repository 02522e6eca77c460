"""Attacks on the publish folded into the queue marker's script (see
tests/test_celery_fold.py for what it does): what else goes through the producer
while the fold is in place, a script that fails after its push, replies that are
lost or late, signal receivers, and the broker's message options. Each test states
the rule: one message on the queue exactly when the marker is taken, and the caller
told the truth.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from kombu import Exchange, Queue

from distlocks import get_backend
from distlocks.contrib.celery import Deduplicated, single_execution
from distlocks.exceptions import LockError
from tests.celery_fold_app import QUEUE, app
from tests.celery_fold_settings import BROKER_DB
from tests.celery_fold_tasks import keeps_result, queued, queued_or_running
from tests.lost_reply_proxy import LostReplyProxy
from tests.test_celery_fold import _marker, _n, _run_next, broker, channel, sends
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

__all__ = ["broker", "channel", "sends"]  # fixtures, used by name


def test_a_sent_event_through_the_same_producer_is_sent_and_the_task_queued_once(
    broker: redis.Redis, channel: Any
) -> None:
    """With ``task_send_sent_event``, Celery publishes the task-sent event through the
    producer it published the task with, while the fold is still in place: that
    second publish must go out as kombu sends it (Celery's event dispatcher would
    swallow an error and keep the event in a buffer), and the task is queued once."""
    n = _n()
    queued.apply_async((n + 1,))
    _run_next(channel, queued)
    events = broker.pubsub()
    events.psubscribe("*celeryev*")
    wait_for(
        lambda: (events.get_message(timeout=0.1) or {}).get("type") == "psubscribe",
        limit=30, what="the subscription",
    )  # fmt: skip
    app.conf.task_send_sent_event = True
    try:
        sent = queued.apply_async((n,))
        heard: list[dict[str, Any]] = []

        def an_event() -> bool:
            message = events.get_message(timeout=0.1)
            if message and message.get("type") == "pmessage":
                heard.append(json.loads(base64.b64decode(json.loads(message["data"])["body"])))
            return any(event.get("uuid") == sent.id for event in heard)

        wait_for(an_event, limit=30, what="the task-sent event")
    finally:
        app.conf.task_send_sent_event = False
        events.close()
    assert broker.llen(QUEUE) == 1
    assert _marker(queued, n).extra["celery_task_id"] == sent.id
    assert _run_next(channel, queued) == n


@pytest.mark.parametrize("part", ["marker", "run lock", "fence", "index"])
def test_a_script_that_fails_publishes_nothing_and_writes_no_marker(
    broker: redis.Redis, part: str
) -> None:
    """A key the script reads or writes holds another type: the marker's hash or the
    run lock's (read before the push), its fencing counter or the listing index
    (written after it). The call fails, and no message stays queued, or a caller
    that tries again would queue the task twice; nor does a marker of this call."""
    n = _n()
    backend = get_backend("broker-db")
    task = queued_or_running if part == "run lock" else queued
    marker = task.lock_name((n,)) + ":queued"
    key = {
        "marker": backend.all_keys(marker).lock,
        "run lock": backend.all_keys(task.lock_name((n,))).lock,
        "fence": backend.all_keys(marker).fence,
        "index": backend.index_key,
    }[part]
    saved = broker.dump(key)
    broker.delete(key)
    broker.rpush(key, "of another type")
    try:
        with pytest.raises(LockError, match="WRONGTYPE"):
            task.apply_async((n,))
        assert broker.llen(QUEUE) == 0
        if part != "marker":
            assert broker.type(backend.all_keys(marker).lock) == b"none"
    finally:
        broker.delete(key)
        if saved is not None:
            broker.restore(key, 0, saved)


@contextlib.contextmanager
def _counting_publishes() -> Iterator[list[str]]:
    heard: list[str] = []

    def before(sender: Any = None, **_: Any) -> None:
        heard.append("before")

    def after(sender: Any = None, **_: Any) -> None:
        heard.append("after")

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    try:
        yield heard
    finally:
        before_task_publish.disconnect(before)
        after_task_publish.disconnect(after)


@pytest.mark.parametrize("task", [queued, queued_or_running], ids=["queued", "queued_or_running"])
def test_publish_signals_are_sent_only_for_a_message_published(
    task: Any, broker: redis.Redis
) -> None:
    """Tracing (OpenTelemetry, ddtrace) opens a span in ``before_task_publish`` and
    closes it in ``after_task_publish``: a duplicate that hears the first and never
    the second would leave a span open in the caller. As without the fold, a
    duplicate sends neither."""
    n = _n()
    task.apply_async((n + 1,))
    with _counting_publishes() as heard:
        first = task.apply_async((n,))
        again = task.apply_async((n,))
    assert again.id == first.id
    assert heard == ["before", "after"]
    assert broker.llen(QUEUE) == 2


@pytest.fixture
def slow_backend(settings: Any) -> Any:
    """A lock backend on the broker's database whose replies time out quickly."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "broker-db": BROKER_DB,
        "broker-db-slow": {**BROKER_DB, "OPTIONS": {"socket_timeout": 0.3}},
    }
    return get_backend("broker-db-slow")


def _same(n: int) -> int:
    return n


impatient = single_execution(
    app=app, name="fold.impatient", backend="broker-db-slow", unique_while="queued",
    ignore_result=True,
)(_same)  # fmt: skip


def test_a_reply_that_came_too_late_leaves_the_marker_with_its_message(
    broker: redis.Redis, slow_backend: Any
) -> None:
    """A long script of another client keeps the server busy past the caller's
    timeout; the caller gives up, and the server then runs the call it had received:
    the message is queued. The marker must stay with it (a plain acquire's timeout
    gives the lock back, in the background, but here that would let the next call
    queue the task a second time)."""
    n = _n()
    impatient.apply_async((n + 1,))  # connected, queue declared, scripts loaded
    slow_backend.release_quietly("not held", "nobody")  # its script loaded
    slow_backend.client.ping()  # a connection in the pool, for a release to use
    broker.delete(QUEUE)
    busy_client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    busy_client.ping()
    started = threading.Event()

    def busy() -> None:
        started.set()
        busy_client.eval(_BUSY, 0, 1500)

    busy_thread = threading.Thread(target=busy)
    busy_thread.start()
    try:
        started.wait(timeout=30)
        wait_for(_server_busy, limit=30, what="the busy server")
        with pytest.raises(LockError):
            impatient.apply_async((n,))
    finally:
        busy_thread.join(timeout=60)
        busy_client.close()
    wait_for(lambda: broker.llen(QUEUE) == 1, limit=30, what="the late script's push")
    wait_for(
        lambda: not any("release_quietly" in t.name for t in threading.enumerate()),
        limit=30, what="the background release",
    )  # fmt: skip
    info = slow_backend.inspect(impatient.lock_name((n,)) + ":queued")
    assert info is not None  # the marker covers the queued message
    again = impatient.apply_async((n,))
    assert again.id == info.extra["celery_task_id"]
    assert broker.llen(QUEUE) == 1


def _server_busy() -> bool:
    """Whether the server is running another client's script (a ping goes unanswered)."""
    probe = redis.Redis.from_url(django_settings.CELERY_BROKER_URL, socket_timeout=0.05)
    try:
        probe.ping()
    except redis.TimeoutError:
        return True
    finally:
        probe.close()
    return False


#: Keeps the server busy for ARGV[1] ms (below its busy-reply threshold, 5 s).
_BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000 + math.floor(t[2] / 1000)
local now = start
while now - start < tonumber(ARGV[1]) do
  t = redis.call('TIME')
  now = t[1] * 1000 + math.floor(t[2] / 1000)
end
return 1
"""


@pytest.fixture
def proxied(settings: Any, broker: redis.Redis) -> Iterator[tuple[LostReplyProxy, dict[str, Any]]]:
    """A Celery app and a lock backend that both reach the broker's database through
    one :class:`LostReplyProxy` (the same host, port and database: the fold is used),
    and a task of that app with its marker there, by ``unique_while`` mode."""
    proxy = LostReplyProxy.to(django_settings.CELERY_BROKER_URL)
    location = proxy.url()
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "proxied": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": location},
    }
    proxied_app = Celery("distlocks-tests-fold-proxied", broker=location)
    proxied_app.conf.task_default_queue = QUEUE
    proxied_app.conf.broker_connection_retry_on_startup = True
    tasks = {
        mode: single_execution(
            app=proxied_app, name=f"fold.proxied.{mode}", backend="proxied",
            unique_while=mode, ignore_result=True,
        )(_same)
        for mode in ("queued", "queued_or_running")
    }  # fmt: skip
    try:
        yield proxy, tasks
    finally:
        proxied_app.close()
        proxy.close()


@pytest.mark.parametrize("lost", [1, 2], ids=["once", "twice"])
def test_a_script_whose_replies_are_lost_queues_its_message_once(
    proxied: tuple[LostReplyProxy, dict[str, Any]], broker: redis.Redis, lost: int
) -> None:
    """The server runs the script and the reply is lost, once (the call is sent again
    on a new connection) or twice (the client gives up): however the caller is
    answered, one message is queued, and the marker covers it."""
    proxy, tasks = proxied
    task = tasks["queued"]
    n = _n()
    task.apply_async((n + 1,))
    broker.delete(QUEUE)

    def lose(replies: int) -> None:
        # The next script's reply is lost; from its loss, the one after it too.
        if replies > 0:
            proxy.lose_reply_to(b"EVALSHA", before_reset=lambda: lose(replies - 1))

    lose(lost)
    try:
        sent = task.apply_async((n,)).id
    except LockError:
        sent = None
    assert proxy.lost == lost  # the replies were lost indeed
    assert broker.llen(QUEUE) == 1
    info = get_backend("proxied").inspect(task.lock_name((n,)) + ":queued")
    assert info is not None
    if sent is not None:
        assert info.extra["celery_task_id"] == sent
    assert task.apply_async((n,)).id == info.extra["celery_task_id"]
    assert broker.llen(QUEUE) == 1


def test_many_threads_queue_one_message_and_all_get_its_id(broker: redis.Redis) -> None:
    """Twelve threads (more than the producer pool's ten) call at once with one key:
    one message is queued, and every caller gets its id."""
    n = _n()
    queued.apply_async((n + 1,))
    broker.delete(QUEUE)
    ids: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(12)

    def call() -> None:
        try:
            start.wait(timeout=30)
            ids.append(queued.apply_async((n,)).id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert len(ids) == 12 and len(set(ids)) == 1
    assert broker.llen(QUEUE) == 1
    assert _marker(queued, n).extra["celery_task_id"] == ids[0]


_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.integers(min_value=0, max_value=9),
        "countdown": st.integers(min_value=0, max_value=3600),
        "expires": st.integers(min_value=60, max_value=3600),
        "headers": st.dictionaries(
            st.sampled_from(["x-a", "x-b"]), st.text(max_size=5), max_size=2
        ),
        "compression": st.sampled_from(["zlib", "gzip", "bzip2"]),
        "serializer": st.sampled_from(["json", "pickle"]),
    },
)


def _queued_messages(broker: redis.Redis) -> dict[bytes, list[dict[str, Any]]]:
    """Every message on the fold queue's keys (one per priority step), by key."""
    found = {}
    for key in broker.scan_iter(match=QUEUE.encode() + b"*"):
        if broker.type(key) == b"list":
            found[key] = [json.loads(raw) for raw in broker.lrange(key, 0, -1)]
    return found


def _shape(message: dict[str, Any]) -> dict[str, Any]:
    """What must be the same in two messages of two calls with the same options."""
    headers = {
        k: v
        for k, v in message["headers"].items()
        if k not in ("id", "root_id", "argsrepr", "eta", "expires")
    }
    properties = {
        k: v
        for k, v in message["properties"].items()
        if k not in ("correlation_id", "delivery_tag")
    }
    return {**message, "body": None, "headers": headers, "properties": properties}


@hsettings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(options=_OPTIONS)
def test_a_folded_message_is_the_one_kombu_publishes_with_any_options(
    options: dict[str, Any], broker: redis.Redis, channel: Any, sends: Any
) -> None:
    """The same call, folded and published the plain way (a producer of the caller's
    own): the message lands on the same key (priority steps), with the same
    properties and headers, and both run on a worker's ``Request``."""
    n = _n()
    _clear(broker)
    try:
        queued.apply_async((n + 2,), **options)  # the queue declared: one round trip
        _clear(broker)
        sends.reset()
        folded = queued.apply_async((n,), **options)
        assert sends.count == 1  # folded
        with app.producer_or_acquire() as producer:
            plain = queued.apply_async((n + 1,), producer=producer, **options)
        assert folded.id != plain.id
        found = _queued_messages(broker)
        assert [len(messages) for messages in found.values()] == [2]
        first, second = next(iter(found.values()))
        by_id = {m["headers"]["id"]: m for m in (first, second)}
        assert _shape(by_id[folded.id]) == _shape(by_id[plain.id])
        if options.get("serializer", "json") == "json":
            assert {_run_next(channel, queued), _run_next(channel, queued)} == {n, n + 1}
    finally:
        _clear(broker)  # the markers left run out


def _clear(broker: redis.Redis) -> None:
    """Empty the fold queue's keys (one per priority step)."""
    for key in broker.scan_iter(match=QUEUE.encode() + b"*"):
        if broker.type(key) == b"list":
            broker.delete(key)


@pytest.fixture
def other_app(broker: redis.Redis) -> Iterator[Celery]:
    """A Celery app on the broker's database with transport options of its own: a
    global key prefix, another priority separator and steps, a queue that expires
    (x-expires) and one on a topic exchange."""
    other = Celery("distlocks-tests-fold-other", broker=django_settings.CELERY_BROKER_URL)
    other.conf.broker_transport_options = {
        "global_keyprefix": "fold-other:",
        "sep": ":",
        "priority_steps": [0, 5],
    }
    other.conf.task_default_queue = QUEUE + "-other"
    other.conf.task_queues = [
        Queue(QUEUE + "-other"),
        Queue(QUEUE + "-expiring", queue_arguments={"x-expires": 600_000}),
        Queue(QUEUE + "-topic", Exchange("fold-topic", type="topic"), routing_key="fold.#"),
    ]
    try:
        yield other
    finally:
        for key in broker.scan_iter(match="fold-other:*"):
            broker.delete(key)
        other.close()


@contextlib.contextmanager
def _commands(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """The commands this thread sends to Redis (as sent, one bytes per request)."""
    seen: list[bytes] = []
    thread = threading.get_ident()
    original = redis.connection.AbstractConnection.send_packed_command

    def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() == thread:
            parts = [command] if isinstance(command, bytes | str) else command
            seen.append(b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in parts))
        original(conn, command, check_health)

    with monkeypatch.context() as patch:
        patch.setattr(
            redis.connection.AbstractConnection, "send_packed_command", send_packed_command
        )
        yield seen


@pytest.mark.parametrize(
    ("options", "queue"),
    [
        ({}, "-other"),
        ({"priority": 7}, "-other:5"),
        ({"queue": QUEUE + "-expiring"}, "-expiring"),
        ({"queue": QUEUE + "-topic", "routing_key": "fold.x"}, "-topic"),
    ],
    ids=["prefix", "priority", "expiring", "topic"],
)
def test_transport_options_and_routes_put_the_message_where_a_worker_reads_it(
    other_app: Celery,
    broker: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    options: dict[str, Any],
    queue: str,
) -> None:
    """The message goes onto the key kombu's consumer reads (the global key prefix,
    the priority separator and steps), an expiring queue keeps its expiry, a topic
    exchange routes it, and a duplicate queues nothing."""
    task = single_execution(
        app=other_app, name="fold.other", backend="broker-db", unique_while="queued",
        ignore_result=True,
    )(_same)  # fmt: skip
    n = _n()
    task.apply_async((n + 1,), **options)  # declared, connected
    for key in broker.scan_iter(match="fold-other:*"):
        if broker.type(key) == b"list":
            broker.delete(key)
    with _commands(monkeypatch) as sent_commands:
        sent = task.apply_async((n,), **options)
    # Folded: the push went in the script (kombu's reads, for routing by a topic, or
    # declaring an expiring queue at each publish, are made either way).
    assert not any(b"\r\nLPUSH\r\n" in command for command in sent_commands)
    assert task.apply_async((n,), **options).id == sent.id
    key = "fold-other:" + QUEUE + queue
    assert broker.llen(key) == 1
    if queue == "-expiring":
        assert broker.pttl(key) > 0
    with other_app.connection_for_read() as connection:
        name = (QUEUE + queue).split(":")[0]
        message = connection.default_channel.basic_get(name, no_ack=True)
    assert message is not None and message.headers["id"] == sent.id


def test_a_forked_child_folds_on_its_own_connections(broker: redis.Redis) -> None:
    """The parent folded (its producer pool and its pinned lock connection are in
    use); a child forked then queues a task and a duplicate of it on connections of
    its own: one message, and the parent's connections still answer it."""
    n = _n()
    parent_first = queued.apply_async((n,))
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, which reports through the pipe
        code = 1
        try:
            first = queued.apply_async((n + 1,)).id
            again = queued.apply_async((n + 1,)).id
            os.write(writer, f"{first} {again}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(reader) as pipe:
        first, again = pipe.read().split()
    assert os.waitstatus_to_exitcode(status) == 0
    assert first == again
    assert broker.llen(QUEUE) == 2
    assert queued.apply_async((n,)).id == parent_first.id
    assert queued.apply_async((n + 1,)).id == first
    assert broker.llen(QUEUE) == 2


def test_a_duplicate_that_carries_a_link_fails_its_own_id_and_its_result_is_read(
    broker: redis.Redis,
) -> None:
    """A duplicate call with ``link=`` is answered from inside the folded publish: its
    own id is failed with Deduplicated (the callback's chain expects it to end), and a
    caller waiting on it reads that failure, though its subscription was dropped."""
    n = _n()
    first = keeps_result.apply_async((n,))
    again = keeps_result.apply_async((n,), link=queued.si(n + 1))
    assert again.id != first.id
    with pytest.raises(Deduplicated):
        again.get(timeout=30)
    assert broker.llen(QUEUE) == 1


def test_delay_on_commit_queues_once_after_the_commit(
    broker: redis.Redis, django_capture_on_commit_callbacks: Any
) -> None:
    """``delay_on_commit()`` twice in one transaction: both calls are made at the
    commit, folded, and one message is queued."""
    n = _n()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        queued.delay_on_commit(n)
        queued.delay_on_commit(n)
        assert broker.llen(QUEUE) == 0
    assert len(callbacks) == 2
    assert broker.llen(QUEUE) == 1
    assert _marker(queued, n) is not None


def test_connections_killed_while_idle_are_made_again_and_the_task_queued_once(
    broker: redis.Redis,
) -> None:
    """The server drops every client connection between two calls (a restart, an idle
    timeout): the next call reconnects and queues its message once, and its duplicate
    nothing."""
    n = _n()
    queued.apply_async((n + 1,))
    broker.delete(QUEUE)
    killer = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    try:
        killer.client_kill_filter(_type="normal", skipme=True)
    finally:
        killer.close()
    sent = queued.apply_async((n,))
    assert queued.apply_async((n,)).id == sent.id
    assert broker.llen(QUEUE) == 1
    assert _marker(queued, n).extra["celery_task_id"] == sent.id


@pytest.fixture
def with_password(settings: Any, broker: redis.Redis) -> Iterator[tuple[Celery, str]]:
    """A Celery app and a lock backend on the broker's database, both logged in as a
    user with a password (an ACL user made for the test)."""
    secret = "fold-" + uuid.uuid4().hex
    user = "fold-user-" + uuid.uuid4().hex[:8]
    broker.acl_setuser(user, enabled=True, passwords=["+" + secret], keys="*", commands=["+@all"])
    url = redis.connection.parse_url(django_settings.CELERY_BROKER_URL)
    host, port, db = url.get("host", "localhost"), url.get("port", 6379), url.get("db", 0)
    location = f"redis://{user}:{secret}@{host}:{port}/{db}"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "with-password": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": location},
    }
    secured = Celery("distlocks-tests-fold-password", broker=location)
    secured.conf.task_default_queue = QUEUE
    try:
        yield secured, secret
    finally:
        secured.close()
        broker.acl_deluser(user)


def test_no_credential_in_what_a_refused_folded_publish_logs_or_raises(
    with_password: tuple[Celery, str], broker: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker's URL holds a password: a push the server refuses (the queue's key of
    another type) is logged and raised without it."""
    secured, secret = with_password
    task = single_execution(
        app=secured, name="fold.secured", backend="with-password", unique_while="queued",
        ignore_result=True,
    )(_same)  # fmt: skip
    n = _n()
    task.apply_async((n + 1,))
    broker.delete(QUEUE)
    broker.set(QUEUE, "not a list")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Exception) as raised:
        task.apply_async((n,))
    assert "WRONGTYPE" in str(raised.value)
    assert "refused" in caplog.text  # the fold's own note, then the plain path's error
    texts = [caplog.text, str(raised.value), repr(raised.value)]
    cause = raised.value.__cause__ or raised.value.__context__
    while cause is not None:
        texts += [str(cause), repr(cause)]
        cause = cause.__cause__ or cause.__context__
    assert not any(secret in text for text in texts)
    assert get_backend("with-password").inspect(task.lock_name((n,)) + ":queued") is None


def test_a_producer_pool_with_one_left_serves_many_threads_each_key_queued_once(
    broker: redis.Redis,
) -> None:
    """All the app's pooled producers but one are in use: eight threads share that
    one, the fold holding it for its script; every call ends, and each of the two
    keys is queued once with every caller of it given its id. (The pool's limit is
    not lowered instead: kombu's limit is global, and shrinks pools in use.)"""
    pool = app.producer_pool
    held = [pool.acquire(block=True, timeout=30) for _ in range(pool.limit - 1)]
    n = _n()
    results: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def call(k: int) -> None:
        try:
            start.wait(timeout=30)
            results.append((k, queued.apply_async((n + k,)).id))
            results.append((k, queued.delay(n + k).id))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i % 2,)) for i in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        for producer in held:
            producer.release()
    assert not errors and len(results) == 16
    ids = {k: {task_id for key, task_id in results if key == k} for k in (0, 1)}
    assert all(len(found) == 1 for found in ids.values())
    assert broker.llen(QUEUE) == 2


def test_a_signature_is_folded_and_deduplicated_as_a_call(broker: redis.Redis) -> None:
    """``sig.apply_async()`` and ``sig.delay()`` of an unfrozen signature are calls
    with a new id: folded, the second answered with the first's id; a frozen one has
    its id already and takes the plain path, with the same answer."""
    n = _n()
    first = queued.s(n).apply_async()
    assert queued.s(n).delay().id == first.id
    frozen = queued.s(n)
    frozen.freeze()
    assert frozen.apply_async().id == first.id
    assert broker.llen(QUEUE) == 1


@pytest.mark.parametrize("task_of", ["queued", "queued_or_running"])
def test_a_call_sent_again_once_its_task_started_does_not_queue_it_again(
    proxied: tuple[LostReplyProxy, dict[str, Any]], broker: redis.Redis, task_of: str
) -> None:
    """The reply is lost, and before the call is sent again the task starts on a
    worker, which lets its marker go ("queued") or takes it over (a run lock held by
    the task, "queued_or_running"): the call sent again must see its own first run
    (its tombstone), not queue the message a second time nor answer with its own
    task's id as another's."""
    proxy, tasks = proxied
    task = tasks[task_of]
    n = _n()
    task.apply_async((n + 1,))
    broker.delete(QUEUE)
    backend = get_backend("proxied")
    marker = task.lock_name((n,)) + ":queued"

    def task_started() -> None:
        # What a worker does as the run starts: the marker goes (or is taken over).
        info = broker.hgetall(backend.all_keys(marker).lock)
        broker.delete(backend.all_keys(marker).lock)
        if task_of == "queued_or_running":
            broker.hset(backend.all_keys(task.lock_name((n,))).lock, mapping=info)

    proxy.lose_reply_to(b"EVALSHA", before_reset=task_started)
    sent = task.apply_async((n,))
    assert proxy.lost == 1
    assert broker.llen(QUEUE) == 1
    assert json.loads(broker.lindex(QUEUE, 0))["headers"]["id"] == sent.id
