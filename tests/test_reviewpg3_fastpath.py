"""Review of the PostgreSQL fast path (named prepared statements sent with psycopg.pq)
and of migration 0004's mint, by attack: an exception raised asynchronously in the
middle of a lock statement (Ctrl-C, a Celery soft time limit, a SIGALRM timeout),
names that fill and evict the per-name cache, odd holder metadata, and the
migration taken back and forth under live rows."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend, session, wire
from distlocks.backends.postgres.pool import Connection
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

HOLDER = Holder(host="h", pid=1, thread="t")


@pytest.fixture
def backend() -> Iterator[PostgresBackend]:
    """A backend of the test's own (its own pool: no statement prepared yet)."""
    made = PostgresBackend("reviewpg3", {"OPTIONS": {}})
    yield made
    made.close()


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt (or Celery's soft time limit): raised by a signal
    handler between two bytecodes, whatever the code was doing."""


def _interrupt(
    monkeypatch: pytest.MonkeyPatch, call: str, statement: bytes, when: str
) -> list[bool]:
    """The next libpq ``call`` ("prepare" or "exec_prepared") of ``statement`` is
    interrupted ``when`` ("before" it is sent, or "after" the server answered)."""
    real = Connection._request
    fired: list[bool] = []

    def request(self: Connection, send: Any, *args: Any) -> Any:
        if not fired and send.__name__ == call and args[0] == statement:
            fired.append(True)
            if when == "before":
                raise Interrupted
            real(self, send, *args)
            raise Interrupted
        return real(self, send, *args)

    monkeypatch.setattr(Connection, "_request", request)
    return fired


def _free(backend: PostgresBackend, name: str) -> bool:
    with psycopg.connect(**backend._connect_kwargs()) as other:
        key = backend.key(name)
        row = other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        return bool(row and row[0])


def _nothing_checked_out(backend: PostgresBackend) -> bool:
    pool = backend.pool
    with pool._lock:
        return pool._count == len(pool._idle) + backend.held_connection_count()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("call", ["prepare", "exec_prepared"])
def test_an_interrupted_renewal_ping_leaves_the_lease_held(
    backend: PostgresBackend, name: str, monkeypatch: pytest.MonkeyPatch, call: str, when: str
) -> None:
    owner = uuid.uuid4().hex
    assert backend.acquire(name, owner, 30.0, HOLDER).acquired
    if call == "exec_prepared":  # prepared by an earlier renewal
        assert backend.extend(name, owner, 30.0)
    fired = _interrupt(monkeypatch, call, session.HOLDS.name, when)
    with pytest.raises(Interrupted):
        backend.extend(name, owner, 30.0)
    assert fired
    monkeypatch.undo()
    # The interrupt said nothing about the lock: its session still holds it.
    assert backend.extend(name, owner, 30.0)
    assert backend.held_connection_count() == 1
    assert not _free(backend, name)
    assert backend.release(name, owner)
    assert _free(backend, name)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("call", ["prepare", "exec_prepared"])
def test_an_interrupted_release_leaves_no_connection_out_and_the_lock_free(
    backend: PostgresBackend, name: str, monkeypatch: pytest.MonkeyPatch, call: str, when: str
) -> None:
    if call == "exec_prepared":  # the unlock statement prepared on the pool's connection
        first = uuid.uuid4().hex
        assert backend.acquire(name, first, 30.0, HOLDER).acquired
        assert backend.release(name, first)
    owner = uuid.uuid4().hex
    assert backend.acquire(name, owner, 30.0, HOLDER).acquired
    fired = _interrupt(monkeypatch, call, session.UNLOCK.name, when)
    with pytest.raises(Interrupted):
        backend.release(name, owner)
    assert fired
    monkeypatch.undo()
    assert backend.held_connection_count() == 0
    # The connection went back to the pool or was closed: none is lost to the pool.
    assert _nothing_checked_out(backend)
    wait_for(lambda: _free(backend, name), what="the lock free after the interrupted release")
    # And the pool's connections still lock and unlock.
    for _ in range(3):
        again = uuid.uuid4().hex
        assert backend.acquire(name, again, 30.0, HOLDER).acquired
        assert backend.extend(name, again, 30.0)
        assert backend.release(name, again)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("call", ["prepare", "exec_prepared"])
def test_an_interrupted_acquire_leaves_no_lock_and_no_connection_out(
    backend: PostgresBackend, name: str, monkeypatch: pytest.MonkeyPatch, call: str, when: str
) -> None:
    if call == "exec_prepared":
        first = uuid.uuid4().hex
        assert backend.acquire(name, first, 30.0, HOLDER).acquired
        assert backend.release(name, first)
    fired = _interrupt(monkeypatch, call, session.ACQUIRE_TRY.name, when)
    with pytest.raises(Interrupted):
        backend.acquire(name, uuid.uuid4().hex, 30.0, HOLDER)
    assert fired
    monkeypatch.undo()
    assert backend.held_connection_count() == 0
    assert _nothing_checked_out(backend)
    assert _free(backend, name)
    owner = uuid.uuid4().hex
    assert backend.acquire(name, owner, 30.0, HOLDER).acquired
    assert backend.release(name, owner)
