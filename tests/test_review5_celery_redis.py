"""Review 5: the calls a single-execution task sends together now go in one socket
write (celery_redis.send_together). A pinned connection that the server ended while
it was idle (a CLIENT KILL, an idle timeout, a restart) fails only at that write or
at the reply: the calls are sent once more on a new connection, and the server must
run each of them exactly once (the dead socket ran nothing). Counted with MONITOR
on the real server, by the test's own unique key names."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from distlocks import get_backend
from distlocks.backends.redis import RedisBackend
from distlocks.contrib import celery_redis
from distlocks.locks import current_holder
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db


def _url() -> str:
    from django.conf import settings

    url: str = settings.DISTLOCKS_BACKENDS["redis"]["LOCATION"]
    return url


class _Monitor:
    """The commands the server runs that name ``needle`` (a MONITOR connection)."""

    def __init__(self, backend: RedisBackend, needle: str) -> None:
        self.needle = needle
        self.lines: list[str] = []
        self._client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(_url()))
        self._monitor = self._client.monitor().__enter__()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._monitor.listen():
                command = event["command"]
                if self.needle in command:
                    self.lines.append(command)
                if "review5-monitor-stop" in command:
                    break
        except (redis.ConnectionError, ValueError):
            pass
        finally:
            self._done.set()

    def stop(self) -> None:
        self._client.exists("review5-monitor-stop")
        self._done.wait(30)
        self._client.close()


@pytest.fixture
def backend() -> RedisBackend:
    found = get_backend("redis")
    assert isinstance(found, RedisBackend) and celery_redis.usable(found)
    return found


@pytest.fixture
def needle() -> str:
    return f"review5-{uuid.uuid4().hex}"


def _kill_pinned(backend: RedisBackend) -> None:
    """End this thread's pinned connection from the server's side while it is idle."""
    conn = backend._pinned()
    assert conn is not None
    conn.send_command("CLIENT", "ID")
    client_id = conn.read_response()
    killer = redis.Redis.from_url(_url())
    try:
        assert killer.client_kill_filter(_id=client_id) == 1
    finally:
        killer.close()


@pytest.mark.parametrize("order", ["acquire-release", "release-acquire"])
def test_a_pinned_connection_killed_while_idle_runs_each_joined_call_once(
    backend: RedisBackend, needle: str, order: str
) -> None:
    run, marker = f"{needle}:run", f"{needle}:marker"
    owner, marker_owner = uuid.uuid4().hex, uuid.uuid4().hex
    holder = current_holder()
    assert backend.acquire(marker, marker_owner, 30.0, holder).acquired
    calls = [
        celery_redis.acquire_call(backend, run, owner, 30.0, holder),
        celery_redis.release_call(backend, marker, marker_owner),
    ]
    if order == "release-acquire":
        calls.reverse()
    # The scripts in the server's cache, so that NOSCRIPT plays no part.
    shas = {}
    for script in ("acquire", "release"):
        registered = backend._scripts[script]
        registered.sha = shas[script] = backend.client.script_load(registered.script)
    monitor = _Monitor(backend, needle)
    try:
        monitor._client.exists(f"review5-monitor-ready:{needle}")
        wait_for(lambda: monitor.lines, 30, "the monitor running")
        _kill_pinned(backend)
        replies = celery_redis.send_together(backend, calls)
        assert replies is not None
        info = backend.inspect(run)
        assert info is not None and info.owner == owner
        assert backend.inspect(marker) is None
        wait_for(lambda: len([c for c in monitor.lines if "EVALSHA" in c.upper()]) >= 2, 30)
        seen = list(monitor.lines)
    finally:
        monitor.stop()
        backend.release(run, owner)

    def runs(script: str, key: str) -> list[str]:
        return [line for line in seen if line.startswith(f"EVALSHA {shas[script]}") and key in line]

    assert len(runs("acquire", f"{{{run}}}")) == 1, seen
    assert len(runs("release", f"{{{marker}}}")) == 1, seen


def test_a_timeout_reading_the_second_reply_leaves_no_reply_for_the_next_call(
    settings: object, needle: str
) -> None:
    """The first reply read, the second late past the socket timeout (the server busy
    with a slow script): the caller hears of the timeout, and the thread's pinned
    connection is not used again with that reply pending (the next call on it would
    read it as its own answer)."""
    from django.conf import settings as django_settings

    alias = f"review5-{uuid.uuid4().hex[:8]}"
    settings.DISTLOCKS_BACKENDS = {  # type: ignore[attr-defined]
        **django_settings.DISTLOCKS_BACKENDS,
        alias: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": _url(),
            "OPTIONS": {"key_prefix": f"r5-{needle[-8:]}", "socket_timeout": 0.5},
        },
    }
    backend = get_backend(alias)
    assert isinstance(backend, RedisBackend) and celery_redis.usable(backend)
    holder = current_holder()
    # Busy for 2 s on the server's clock, then answers: later than the socket timeout.
    slow = celery_redis._Script(
        "local t = redis.call('TIME') local s = t[1] * 1e6 + t[2]"
        " while true do t = redis.call('TIME')"
        " if t[1] * 1e6 + t[2] - s > 2e6 then break end end"
        " return 'late reply'"
    )
    backend.client.script_load(slow.script)
    owner = uuid.uuid4().hex
    calls = [
        celery_redis.acquire_call(backend, f"{needle}:first", owner, 30.0, holder),
        (slow, [], []),
    ]
    with pytest.raises(redis.TimeoutError):
        celery_redis.send_together(backend, calls)
    # The next call on this thread's connection gets its own answer.
    other = uuid.uuid4().hex
    patient = redis.Redis.from_url(_url(), socket_timeout=60)
    assert patient.ping()  # answered once the slow script is over
    patient.close()
    result = backend.acquire(f"{needle}:second", other, 30.0, holder)
    assert result.acquired and result.fencing_token > 0
    assert backend.inspect(f"{needle}:second").owner == other  # type: ignore[union-attr]
    assert backend.release(f"{needle}:second", other)
    assert backend.release(f"{needle}:first", owner)
