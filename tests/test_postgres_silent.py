"""PostgresBackend against a server that stops answering without closing anything.

A server that is stopped or frozen, or a network that swallows packets while a
middlebox still acknowledges them, leaves libpq waiting with a live TCP connection:
keepalives and ``tcp_user_timeout`` never fire. The fault proxy of the fault suite,
blackholed, is such a server. Every request on distlocks' own connections must then
end after ``OPTIONS["socket_timeout"]`` (plus the lock wait, for a waiting acquire).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.backends.postgres import NoAnswer, PostgresBackend
from distlocks.checks import check_settings
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from tests.faults.proxy import FaultProxy
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

BACKEND = "distlocks.backends.postgres.PostgresBackend"
REPLY = 0.5  # the socket_timeout of the proxied alias
SLACK = 3.0  # generous: the machine may be loaded; a hang would take forever


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    started = FaultProxy(int(connection.settings_dict["PORT"])).start()
    yield started
    started.close()


@pytest.fixture
def silent(proxy: FaultProxy) -> Iterator[str]:
    """An alias whose lock connections go through the proxy (socket_timeout 0.5 s)."""
    config = {
        **settings.DISTLOCKS_BACKENDS,
        "pgproxied": {"BACKEND": BACKEND, "OPTIONS": {"socket_timeout": REPLY}},
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = get_backend("pgproxied")
        assert isinstance(backend, PostgresBackend)
        # The same database, reached through the proxy: only the address changes.
        params = {**backend._connect_kwargs(), "host": "127.0.0.1", "port": proxy.port}
        backend._connect_kwargs = lambda: params  # type: ignore[method-assign]
        yield "pgproxied"


def warm(alias: str, name: str) -> None:
    """Leave a pooled connection open, so the next request needs no new connection."""
    with lock(f"{name}:warm", backend=alias, timeout=0):
        pass


def test_an_acquire_on_a_silent_server_fails_after_the_socket_timeout(
    silent: str, proxy: FaultProxy, name: str
) -> None:
    warm(silent, name)
    proxy.blackhole()
    start = time.monotonic()
    with pytest.raises(LockBackendUnavailable) as excinfo:
        lock(name, backend=silent, timeout=0).acquire()
    elapsed = time.monotonic() - start
    assert REPLY * 0.9 <= elapsed < REPLY + SLACK
    assert isinstance(excinfo.value.__cause__, NoAnswer)
    assert "socket_timeout" in str(excinfo.value)


def test_a_lock_wait_longer_than_the_socket_timeout_is_not_cut(
    silent: str, proxy: FaultProxy, name: str
) -> None:
    """The server answers a waiting acquire only when the wait ends; that silence is
    expected and must not count against the socket timeout."""
    with lock(name, backend="pg"):
        start = time.monotonic()
        with pytest.raises(LockNotAcquired):
            lock(name, backend=silent, timeout=REPLY * 3).acquire()
        assert time.monotonic() - start >= REPLY * 3 * 0.9
        # The same wait on a silent server ends after the wait plus the socket timeout.
        proxy.blackhole()
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable) as excinfo:
            lock(name, backend=silent, timeout=REPLY * 2).acquire()
        elapsed = time.monotonic() - start
        assert REPLY * 3 * 0.9 <= elapsed < REPLY * 3 + SLACK
        assert isinstance(excinfo.value.__cause__, NoAnswer)


def test_a_holder_whose_server_goes_silent_learns_it_lost_the_lock(
    silent: str, proxy: FaultProxy, name: str
) -> None:
    lease = lock(name, backend=silent, ttl=30, auto_renew=False).acquire()
    proxy.blackhole()
    start = time.monotonic()
    with pytest.raises(LockLost):
        lease.extend()
    assert time.monotonic() - start < REPLY + SLACK
    assert not lease.held()
    # Its connection was closed: once the server hears of it (the proxy passes the
    # close on when it relays again), the lock is free for the next holder.
    proxy.heal()
    wait_for(lambda: _free(name), what="the lock freed by the server")


def test_a_release_on_a_silent_server_returns_after_the_socket_timeout(
    silent: str, proxy: FaultProxy, name: str
) -> None:
    lease = lock(name, backend=silent, ttl=30, auto_renew=False).acquire()
    proxy.blackhole()
    start = time.monotonic()
    assert lease.release() is False
    assert time.monotonic() - start < REPLY + SLACK
    assert not lease.held()
    with pytest.raises(LockBackendUnavailable):  # inspection too
        get_backend(silent).inspect(name)


def _free(name: str) -> bool:
    try:
        with lock(name, backend="pg", timeout=0):
            return True
    except LockNotAcquired:
        return False


def test_the_backend_recovers_when_the_server_answers_again(
    silent: str, proxy: FaultProxy, name: str
) -> None:
    warm(silent, name)
    proxy.blackhole()
    with pytest.raises(LockBackendUnavailable):
        lock(name, backend=silent, timeout=0).acquire()
    proxy.heal()
    # The cut connection was discarded, not returned to the pool.
    with lock(name, backend=silent, timeout=0) as lease:
        assert lease.held()


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_a_bad_socket_timeout_fails_the_checks(value: object) -> None:
    config = {"default": {"BACKEND": BACKEND, "OPTIONS": {"socket_timeout": value}}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        messages = check_settings()
    assert [m.id for m in messages] == ["distlocks.E004"]
    assert "socket_timeout" in (messages[0].hint or "")
