"""Review 8 of the PostgreSQL backend: pooled connections that died, or went silent,
while idle in the pool, behind a proxy between the process and the real server
(tests/faults/proxy.py). The next lock() succeeds on a new connection, or fails with
LockBackendUnavailable within the socket timeout; it never hangs, and never reports a
lock the server does not hold (checked in pg_locks, from a session of Django's own).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.backends.postgres import PostgresBackend
from distlocks.backends.postgres.keys import key_parts
from distlocks.exceptions import LockBackendUnavailable
from tests.faults.proxy import FaultProxy
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


@pytest.fixture
def proxied() -> Iterator[tuple[str, FaultProxy]]:
    """An alias whose lock connections go through a fault proxy (socket timeout 1 s)."""
    proxy = FaultProxy(int(connection.settings_dict["PORT"])).start()
    config = {
        **settings.DISTLOCKS_BACKENDS,
        "proxiedpg": {
            "BACKEND": "distlocks.backends.postgres.PostgresBackend",
            "OPTIONS": {"socket_timeout": 1, "connect_timeout": 2, "pool_size": 4},
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = get_backend("proxiedpg")
        assert isinstance(backend, PostgresBackend)
        params = {**backend._connect_kwargs(), "host": "127.0.0.1", "port": proxy.port}
        backend._connect_kwargs = lambda: params  # type: ignore[method-assign]
        try:
            yield "proxiedpg", proxy
        finally:
            proxy.heal()
            backend.close()
            proxy.close()


def holders(backend: PostgresBackend, name: str) -> list[int]:
    classid, objid = key_parts(backend.key(name))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            [classid, objid],
        )
        return [row[0] for row in cursor.fetchall()]


def outcome_of(call: Any) -> BaseException | Any:
    """``call()``'s result or exception, on a thread joined within a generous bound
    (a hang fails the test instead of the session). The thread makes no query of
    Django's: its own connection would outlive the test."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "lock() hung on a silent pooled connection"
    return box[0]


@pytest.mark.parametrize("fault", ["blackhole", "latency", "reset"])
def test_an_idle_pooled_connection_gone_bad_never_hangs_nor_lies(
    proxied: tuple[str, FaultProxy], name: str, fault: str
) -> None:
    alias, proxy = proxied
    backend = get_backend(alias)
    assert isinstance(backend, PostgresBackend)
    with lock(name, backend=alias, ttl=30, timeout=0) as lease:
        first = lease.fencing_token
    assert len(backend.pool._idle) == 1
    if fault == "blackhole":
        proxy.blackhole()  # the connection (and any new one) goes silent
    elif fault == "latency":
        proxy.set_latency(3)  # the request reaches the server after the client gave up
    else:
        assert proxy.reset() >= 1  # cut under the idle connection

    got = outcome_of(lambda: lock(name, backend=alias, ttl=30, timeout=0).acquire())
    if fault == "reset":
        # The dead connection is seen before use and replaced: the lock is taken.
        assert not isinstance(got, BaseException), repr(got)
        assert got.fencing_token > first
        assert len(holders(backend, name)) == 1  # and the server agrees
        got.release()
    else:
        assert isinstance(got, LockBackendUnavailable), repr(got)
    proxy.heal()
    # Whatever reached the server late ends with the session the client dropped.
    wait_for(lambda: holders(backend, name) == [], limit=60, what="no holder left")
    with lock(name, backend=alias, ttl=30, timeout=0) as lease:
        assert lease.fencing_token > first
        assert len(holders(backend, name)) == 1
    assert holders(backend, name) == []
