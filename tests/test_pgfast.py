"""The PostgreSQL try's fast path (issue 29): ``lock(..., timeout=0)`` goes through
``locks.try_once()`` (no waiting machinery), and the session backend reuses the
encoded parameters of a name's last try for the next one by the same holder with
the same ttl (only the owner is encoded anew). Each test holds one of the
guarantees the longer path gave: what the registry records, fork, a pooled
connection that died while idle, force release with ``on_lost``, a settings change
between cycles, and what a refused try tells its receivers."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.test import override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import lock
from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend
from distlocks.exceptions import LockLost, LockNotAcquired
from distlocks.locks import holder_extra
from distlocks.signals import lock_not_acquired
from tests.pg_backend import pg
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


@pytest.fixture
def thread_named() -> Iterator[Any]:
    """Rename the calling thread for a while (the holder records its name)."""
    thread = threading.current_thread()
    before = thread.name

    def rename(new: str) -> None:
        thread.name = new

    yield rename
    thread.name = before


@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([1, 1.0, 30, 30.0, 0.1 + 0.2, 7.5, 3600.0]),
            st.sampled_from(["fast-a", "fast-b"]),
            st.sampled_from([None, {"job": "one"}, {"job": "two"}]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_each_try_records_its_own_ttl_holder_and_owner(
    name: str, thread_named: Any, steps: list[tuple[float, str, dict[str, str] | None]]
) -> None:
    """Whatever the order of ttls, thread names and extras, each try records its own
    (the reused parameters are never another try's), with a token above the last."""
    last = 0
    for ttl, thread, extra in steps:
        thread_named(thread)
        token = holder_extra.set(extra) if extra is not None else None
        try:
            with lock(name, backend="pg", ttl=ttl, timeout=0) as lease:
                info = pg().inspect(name)
        finally:
            if token is not None:
                holder_extra.reset(token)
        assert info is not None
        assert (info.owner, info.fencing_token) == (lease.owner, lease.fencing_token)
        assert (info.ttl, info.thread, info.pid) == (float(ttl), thread, os.getpid())
        # (the listing adds the session's own keys to the holder's extras)
        assert info.extra.get("job") == (extra or {}).get("job")
        assert lease.fencing_token > last
        last = lease.fencing_token


@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ttls=st.lists(st.sampled_from([1, 1.0, 2.5, 30.0, 0.1 + 0.2]), min_size=2, max_size=6))
def test_one_holder_object_with_changing_ttls_at_the_backend(name: str, ttls: list[float]) -> None:
    """The same Holder object (as a thread passes it) with another ttl: the ttl sent is
    the one given, as psycopg would send it (1 and 1.0 are one value for the column)."""
    backend = pg()
    holder = Holder(host="fast-host", pid=4242, thread="fast-thread")
    for ttl in ttls:
        owner = os.urandom(16).hex()
        assert backend.acquire(name, owner, ttl, holder).acquired
        try:
            info = backend.inspect(name)
            assert info is not None
            assert (info.owner, info.ttl, info.pid, info.host) == (
                owner,
                float(ttl),
                4242,
                "fast-host",
            )
        finally:
            assert backend.release(name, owner)


def test_a_forked_child_tries_on_its_own_connections_as_itself(name: str) -> None:
    """A child forked while its parent holds a lease (taken by the fast path): its try
    of the same name is refused, its try of another name records the child's pid (not
    the parent's reused parameters), and the parent's lease lives on."""
    other = name + ":child"
    with lock(other, backend="pg", ttl=30, timeout=0):  # the parent's cache for other
        pass
    with lock(name, backend="pg", ttl=30, timeout=0) as lease:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    with lock(name, backend="pg", ttl=30, timeout=0):
                        pass
                except LockNotAcquired:
                    with lock(other, backend="pg", ttl=30, timeout=0):
                        info = pg().inspect(other)
                        if info is not None and info.pid == os.getpid():
                            code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        lease.extend()  # still the parent's, on its own session
        assert lease.held()
    assert lease.state == "released"


def test_a_try_after_the_idle_connection_died_gets_a_new_one(name: str) -> None:
    """The connection the last cycle gave back was ended by the server while idle (a
    DBA's pg_terminate_backend): the next try takes a live one, not an error."""
    with lock(name, backend="pg", ttl=30, timeout=0) as first:
        pass
    idle = pg().pool._idle[-1]
    victim = idle.info.backend_pid
    with psycopg.connect(**pg()._connect_kwargs()) as dba:
        dba.execute("SELECT pg_terminate_backend(%s)", (victim,))
        wait_for(
            lambda: (
                dba.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (victim,)
                ).fetchone()
                == (0,)
            ),
            15,
            "the idle session ended",
        )
    with lock(name, backend="pg", ttl=30, timeout=0) as second:
        assert pg()._held[second.owner].conn.info.backend_pid != victim
    assert second.fencing_token > first.fencing_token


def test_a_force_released_try_tells_its_holder(name: str) -> None:
    """Force release of a lease the fast path took: its holder learns it (extend raises
    LockLost, on_lost runs once, the block ends with LockLost) and the next holder's
    token is higher."""
    lost: list[Any] = []

    def ended(lease: Any) -> bool:
        try:
            lease.extend()
        except LockLost:
            return True
        return False

    with pytest.raises(LockLost):
        with lock(name, backend="pg", ttl=30, timeout=0, on_lost=lost.append) as lease:
            assert pg().force_release(name, lease.fencing_token)
            wait_for(lambda: ended(lease), 15, "the holder's session ended")
    assert lost == [lease]
    assert pg().held_connection_count() == 0 or lease.owner not in pg()._held
    with lock(name, backend="pg", ttl=30, timeout=0) as again:
        assert again.fencing_token > lease.fencing_token


def test_tries_across_a_settings_change(name: str) -> None:
    """Backends are rebuilt when DISTLOCKS_BACKENDS changes: the try on the new
    backend uses none of the old one's connections or cached parameters, and tokens
    keep rising across the change and back."""
    with lock(name, backend="pg", ttl=30, timeout=0) as first:
        old = pg()
        old_conn = old._held[first.owner].conn
    changed = {
        **settings.DISTLOCKS_BACKENDS,
        "pg": {
            **settings.DISTLOCKS_BACKENDS["pg"],
            "OPTIONS": {
                **settings.DISTLOCKS_BACKENDS["pg"].get("OPTIONS", {}),
                "application_name": "distlocks-fast-test",
            },
        },
    }
    with override_settings(DISTLOCKS_BACKENDS=changed):
        with lock(name, backend="pg", ttl=30, timeout=0) as second:
            new = pg()
            assert new is not old
            conn = new._held[second.owner].conn
            assert (
                conn is not old_conn
                and conn.info.parameter_status("application_name") == "distlocks-fast-test"
            )
    assert old_conn.closed  # the old pool closed the connection given back to it
    with lock(name, backend="pg", ttl=30, timeout=0) as third:
        assert pg() is not new
    assert first.fencing_token < second.fencing_token < third.fencing_token


def test_a_refused_try_tells_lock_not_acquired_receivers(name: str) -> None:
    """A try refused on the fast path raises LockNotAcquired and sends
    lock_not_acquired once, with what the longer path sends."""
    got: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append({"sender": sender, **kwargs})

    holder = Holder(host="h", pid=1, thread="t")
    owner = os.urandom(16).hex()
    assert pg().acquire(name, owner, 30.0, holder).acquired
    lock_not_acquired.connect(receiver)
    try:
        with pytest.raises(LockNotAcquired) as raised:
            lock(name, backend="pg", ttl=30, timeout=0).acquire()
    finally:
        lock_not_acquired.disconnect(receiver)
        assert pg().release(name, owner)
    assert len(got) == 1
    assert got[0]["sender"] is PostgresBackend
    assert (got[0]["name"], got[0]["backend"]) == (name, "pg")
    assert got[0]["error"] is raised.value and got[0]["waited"] >= 0
