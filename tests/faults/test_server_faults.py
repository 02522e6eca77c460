"""Faults of the lock server: a Redis killed and restarted empty, a PostgreSQL
session terminated under its holder."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.exceptions import LockBackendUnavailable
from distlocks.testing.servers import RedisServer
from tests.faults.helpers import MakeScenario, newer_write, of, redis_config

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WORKERS = ("w1", "w2", "w3")


def test_redis_killed_and_restarted_empty(scenario: MakeScenario, tmp_path: Path) -> None:
    """The server dies with every lock and fencing counter it had (no persistence).
    While it is down the backend answers LockBackendUnavailable; after it comes back
    on the same port, work goes on, and every token is above every earlier one
    (they are floored by the server clock), so fencing still orders the writes."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    try:
        config = redis_config(server.url)
        s = scenario("redis-restart")
        for proc in WORKERS:
            s.spawn(proc, backend=config, ttl=1.0, rounds=1000)
        s.wait_accepted(6)
        # w1 is inside its critical section when the server dies.
        s.hold("w1", "inside")
        token = s.wait_at("w1", "inside")
        port = server.port
        with s.fault("redis killed and restarted empty", ends_leases=True):
            server.kill()
            killed_at = time.monotonic()
            backends = {**settings.DISTLOCKS_BACKENDS, "faults": config}
            with override_settings(DISTLOCKS_BACKENDS=backends):
                with pytest.raises(LockBackendUnavailable):
                    lock(s.lock, backend="faults", timeout=0).acquire()
            for proc in WORKERS[1:]:  # the others were told, none hung
                s.wait_event(
                    lambda e, p=proc: of("unavailable", p)(e) and e["t"] > killed_at,
                    f"{proc} told the server is down",
                )
            server.start(port=port)
            restarted_at = time.monotonic()
        # The lock was lost with the data: another worker takes it and writes...
        s.wait_event(newer_write(token), "a write by a holder after the restart")
        s.go("w1", "inside")
        # ...so the holder from before the restart is refused.
        late = s.wait_event(of("write", "w1", op="increment", token=token), "w1's late write")
        s.wait_accepted(4, after=restarted_at)
        s.stop()
        s.join()
        report = s.check()
    finally:
        server.stop()
    assert late["accepted"] is False
    assert report.takeovers >= 1 and report.faults == 1
    before = [e["token"] for e in s.events("acquire") if e["t1"] < killed_at]
    after = [e["token"] for e in s.events("acquire") if e["t0"] > restarted_at]
    assert before and after and min(after) > max(before)


def test_postgres_session_of_the_holder_terminated(scenario: MakeScenario) -> None:
    """pg_terminate_backend on the holder's lock session frees the lock at once.
    The holder learns it lost it (the lock_lost signal, LockLost at the end of its
    block), and its later fenced write is refused, since the next holder has
    claimed the row."""
    s = scenario("pg-terminate")
    s.hold("victim", "inside")
    s.spawn("victim", alias="pg", ttl=1.0, rounds=1)
    s.spawn("w1", alias="pg", ttl=1.0, rounds=3, gate=True)
    token = s.wait_at("victim", "inside")
    info = get_backend("pg").inspect(s.lock)
    assert info is not None and info.fencing_token == token
    with s.fault("pg_terminate_backend of the holder's session", ends_leases=True):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [info.extra["backend_pid"]])
            assert cursor.fetchone()[0] is True
    s.hold("w1", "inside")
    s.open_gate("w1")
    s.wait_at("w1", "inside")  # the next holder has the lock and has claimed the row
    s.wait_event(newer_write(token), "the next holder's claim")
    lost = s.wait_event(of("lost", "victim", token=token), "the holder told of its loss")
    s.go("victim", "inside")
    late = s.wait_event(of("write", "victim", op="increment"), "the holder's late write")
    s.go("w1", "inside")
    s.join()
    report = s.check()
    assert late["accepted"] is False
    assert "renewal" in lost["reason"]
    exit_ = s.wait_event(of("release", "victim"), "the holder's release")
    assert exit_["ok"] is False and exit_["error"].startswith("LockLost")
    assert report.takeovers >= 1 and report.increments == 3
