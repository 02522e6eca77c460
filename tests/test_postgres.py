"""PostgresBackend specifics: keys, registry, crash release, force release, modes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import zlib
from pathlib import Path

import psycopg
import pytest
from django.db import connection, connections, transaction
from django.test import override_settings

from distlocks import get_backend, lock
from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend, key_parts, lock_key
from distlocks.checks import check_settings
from distlocks.exceptions import LockError, LockNotAcquired
from distlocks.models import LockRegistry
from tests import workers
from tests.pg_backend import pg
from tests.waiting import wait_for, wait_for_text

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


def advisory_holders(key: int) -> list[int]:
    classid, objid = key_parts(key)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            [classid, objid],
        )
        return [row[0] for row in cursor.fetchall()]


def test_crc32_collision_names_are_independent_locks(name: str) -> None:
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")
    first, second = f"{name}:plumless"[:0] + "plumless", "buckeroo"
    assert lock_key("distlocks-test", first) != lock_key("distlocks-test", second)
    with lock(first, backend="pg") as a, lock(second, backend="pg", timeout=0) as b:
        assert a.held() and b.held()
        assert {i.name for i in pg().iter_locks()} >= {first, second}


def test_key_is_a_sha256_of_prefix_and_name() -> None:
    import hashlib
    import struct

    digest = hashlib.sha256(b"p\x00n").digest()
    assert lock_key("p", "n") == struct.unpack(">q", digest[:8])[0]
    # pg_locks splits the key into its high and low 32 bits.
    assert key_parts(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert key_parts(1 << 32 | 7) == (1, 7)


def test_registry_row_and_pg_locks_agree(name: str) -> None:
    backend = pg()
    with lock(name, backend="pg", ttl=12) as lease:
        row = LockRegistry.objects.get(key=backend.key(name))
        assert row.name == name
        assert row.fencing_token == lease.fencing_token
        assert row.owner == lease.owner
        assert row.pid == os.getpid()
        holders = advisory_holders(backend.key(name))
        assert holders == [row.backend_pid]
        info = backend.inspect(name)
        assert info is not None
        assert info.extra["backend_pid"] == row.backend_pid
        assert info.extra["application_name"] == "distlocks"
        assert info.extra["client_addr"] == "127.0.0.1"
        assert info.ttl == 12
        assert info.acquired_at is not None
    assert advisory_holders(backend.key(name)) == []
    assert backend.inspect(name) is None
    # The registry keeps the counter for the next holder.
    assert LockRegistry.objects.get(key=backend.key(name)).fencing_token == lease.fencing_token


def test_lock_connection_is_not_djangos(name: str) -> None:
    with lock(name, backend="pg") as lease:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            django_pid = cursor.fetchone()[0]
        assert advisory_holders(pg().key(name)) != [django_pid]
        # Django closing its connections never drops the lock.
        connections.close_all()
        assert pg().inspect(name) is not None
        assert lease.held()


def test_waiters_are_listed(name: str) -> None:
    holder = lock(name, backend="pg").acquire()
    waiter = threading.Thread(
        target=lambda: lock(name, backend="pg", timeout=10).acquire().release()
    )
    waiter.start()
    wait_for(lambda: (pg().inspect(name).waiters or 0) == 1, what="waiter queued")
    holder.release()
    waiter.join(10)
    assert pg().inspect(name) is None


def test_timeout_uses_the_server_queue_and_leaves_nothing_behind(name: str) -> None:
    backend = pg()
    holder = lock(name, backend="pg").acquire()
    start = time.monotonic()
    with pytest.raises(LockNotAcquired):
        lock(name, backend="pg", timeout=0.3).acquire()
    assert time.monotonic() - start >= 0.3
    # Only the holder's session has the lock; the timed-out connection holds nothing.
    assert advisory_holders(backend.key(name)) == [holder_pid(holder.owner)]
    holder.release()
    assert advisory_holders(backend.key(name)) == []


def holder_pid(owner: str) -> int:
    return int(LockRegistry.objects.get(owner=owner).backend_pid)  # type: ignore[arg-type]


def test_error_after_grant_does_not_leave_the_lock_held(name: str) -> None:
    """The lock is granted, then the same statement fails (a pid out of the integer
    range): the session lock must not survive on a pooled connection."""
    backend = pg()
    bad = Holder(host="h", pid=2**40, thread="t")
    for wait in (0.0, 2.0):
        with pytest.raises(Exception, match="out of range"):
            backend.acquire(name, f"owner-{wait}", 5, bad, wait=wait)
        # The failed connection is closed; its session ends a moment later.
        wait_for(lambda: advisory_holders(backend.key(name)) == [], what="session gone")
    with lock(name, backend="pg", timeout=0) as lease:
        assert lease.held()


@pytest.mark.slow
def test_killed_holder_frees_the_lock_when_its_connection_closes(name: str, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=workers.hold_until_killed, args=("pg", name, str(ready)))
    proc.start()
    first_token = int(wait_for_text(ready, what="holder ready"))
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
    killed_at = time.monotonic()
    with lock(name, backend="pg", timeout=10) as lease:
        freed_after = time.monotonic() - killed_at
    proc.join(5)
    assert lease.fencing_token > first_token
    print(f"\nlock freed {freed_after * 1000:.0f} ms after SIGKILL of its holder")
    assert freed_after < 5


@pytest.mark.slow
def test_force_release_terminates_the_holder_and_bumps_the_token(name: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=workers.hold_until_lost, args=("pg", name, str(log)))
    proc.start()
    wait_for(lambda: log.exists() and "acquired" in log.read_text(), what="holder ready")
    token = int(log.read_text().split()[1])
    assert pg().force_release(name) is True
    # The counter moved at the force release: the evicted holder's token is stale.
    bumped = pg().fencing_counter(name)
    assert bumped > token
    with lock(name, backend="pg", timeout=5) as lease:
        assert lease.fencing_token > bumped
    proc.join(20)
    assert "lost" in log.read_text(), log.read_text()
    assert pg().force_release(name) is False


class TestTransactionMode:
    def test_needs_an_atomic_block(self, name: str) -> None:
        with pytest.raises(LockError, match=r"inside transaction.atomic\(using='default'\)"):
            lock(name, backend="pgx").acquire()

    def test_held_until_commit(self, name: str) -> None:
        backend = get_backend("pgx")
        with transaction.atomic():
            lease = lock(name, backend="pgx", timeout=0).acquire()
            assert lease.fencing_token >= 1
            assert lease.expires_at is None
            assert lease.release() is True  # forgets it; the lock lasts until COMMIT
            assert advisory_holders(backend.key(name)) != []  # type: ignore[attr-defined]
            with pytest.raises(LockNotAcquired):
                lock(name, backend="pg", timeout=0).acquire()
        assert advisory_holders(backend.key(name)) == []  # type: ignore[attr-defined]

    def test_rollback_frees_it(self, name: str) -> None:
        backend = get_backend("pgx")
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            lock(name, backend="pgx").acquire()
            1 / 0  # noqa: B018
        assert advisory_holders(backend.key(name)) == []  # type: ignore[attr-defined]

    def test_timeout_does_not_break_the_callers_transaction(self, name: str) -> None:
        holder = lock(name, backend="pg").acquire()
        with transaction.atomic():
            with pytest.raises(LockNotAcquired):
                lock(name, backend="pgx", timeout=0.2).acquire()
            with connection.cursor() as cursor:  # the transaction is still usable
                cursor.execute("SELECT current_setting('lock_timeout')")
                assert cursor.fetchone()[0] == "0"
        holder.release()
        with transaction.atomic():
            assert lock(name, backend="pgx", timeout=1).acquire().held()

    def test_tokens_shared_with_session_mode(self, name: str) -> None:
        with lock(name, backend="pg") as first:
            pass
        with transaction.atomic():
            second = lock(name, backend="pgx").acquire()
        assert second.fencing_token > first.fencing_token


def test_checks_for_postgres_settings() -> None:
    base = {"BACKEND": "distlocks.backends.postgres.PostgresBackend"}
    databases = {
        "default": connection.settings_dict,
        "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    }
    cases = {
        "E008": {"default": {**base, "DATABASE": "lite"}},
        "E009": {"default": {**base, "OPTIONS": {"pooler": "transaction"}}},
        "E004": {"default": {**base, "OPTIONS": {"mode": "sometimes"}}},
    }
    for expected, config in cases.items():
        with override_settings(DATABASES=databases, DISTLOCKS_BACKENDS=config):
            assert [m.id for m in check_settings()] == [f"distlocks.{expected}"]
    ok = {"default": {**base, "OPTIONS": {"mode": "transaction", "pooler": "transaction"}}}
    with override_settings(DISTLOCKS_BACKENDS=ok):
        assert check_settings() == []


def test_unreachable_server_is_unavailable_quickly(name: str) -> None:
    import socket

    from distlocks.exceptions import LockBackendUnavailable

    backend = pg()
    real_kwargs = backend._connect_kwargs()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = sock.getsockname()[1]
        backend._connect_kwargs = lambda: {**real_kwargs, "port": port}  # type: ignore[method-assign]
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable) as excinfo:
            lock(name, backend="pg", timeout=0).acquire()
        assert isinstance(excinfo.value.__cause__, psycopg.OperationalError)
        assert time.monotonic() - start < 5


class TestLeaseEnds:
    def test_a_lease_lost_locally_is_freed_on_the_server_at_release(self, name: str) -> None:
        lease = lock(name, backend="pg", ttl=0.1, auto_renew=False).acquire()
        wait_for(lambda: not lease.held(), what="local deadline")
        assert pg().inspect(name) is not None  # PostgreSQL itself never expires it
        assert lease.release() is False  # lost...
        assert pg().inspect(name) is None  # ...but no longer held on the server
        assert pg().held_connection_count() == 0

    def test_max_hold_frees_the_lock_on_the_server(self, name: str) -> None:
        lost = threading.Event()
        lease = lock(name, backend="pg", ttl=0.2, max_hold=0.3, on_lost=lambda _: lost.set())
        held = lease.acquire()  # kept referenced: a dropped lease is a different case
        assert lost.wait(5)
        assert "max_hold" in held.lost_reason
        wait_for(lambda: pg().inspect(name) is None, what="freed by the renewer")

    def test_a_dropped_lease_is_released(self, name: str) -> None:
        import gc

        lock(name, backend="pg", ttl=0.3).acquire()
        gc.collect()
        wait_for(lambda: pg().inspect(name) is None, what="released by the renewer")

    def test_a_long_wait_in_the_queue_does_not_lose_the_lease(self, name: str) -> None:
        holder = lock(name, backend="pg").acquire()
        threading.Timer(0.8, holder.release).start()
        lease = lock(name, backend="pg", ttl=0.3, timeout=5).acquire()
        assert lease.held()  # the 0.3 s lease starts at the grant, after a 0.8 s wait
        lease.release()

    def test_rolled_back_savepoint_is_noticed(self, name: str) -> None:
        from distlocks.exceptions import LockLost

        with transaction.atomic():
            with pytest.raises(RuntimeError), transaction.atomic():
                lease = lock(name, backend="pgx").acquire()
                raise RuntimeError("rolls the savepoint back, and the lock with it")
            with pytest.raises(LockLost):
                lease.extend()
            assert lock(name, backend="pg", timeout=0).acquire().release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_does_not_share_the_parents_sessions(name: str) -> None:
    lease = lock(name, backend="pg").acquire()
    pid = os.fork()
    if pid == 0:  # the child: a fresh pool, and the parent's lock is not its own
        code = 1
        try:
            try:
                lock(name, backend="pg", timeout=0).acquire()
            except LockNotAcquired:
                with lock(f"{name}:child", backend="pg", timeout=0) as child:
                    code = 0 if child.held() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lease.held()
    assert pg().inspect(name).owner == lease.owner
    lease.release()


def test_a_dropped_unrenewed_lease_is_released(name: str) -> None:
    import gc

    lock(name, backend="pg", auto_renew=False).acquire()  # dropped at once
    gc.collect()
    wait_for(lambda: pg().inspect(name) is None, what="released after the drop")


def test_only_a_lease_dropped_while_held_costs_a_clean_up_thread(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    from distlocks import locks

    started: list[str] = []
    real = locks._in_thread
    monkeypatch.setattr(
        locks, "_in_thread", lambda func, *args: (started.append(args[1]), real(func, *args))
    )
    for _ in range(20):  # released, then collected: nothing left to free
        with lock(name, backend="pg", auto_renew=False):
            pass
    gc.collect()
    assert started == []
    lock(name, backend="pg", auto_renew=False).acquire()  # dropped while held
    gc.collect()
    assert started == [name]
    wait_for(lambda: pg().inspect(name) is None, what="released after the drop")


class TestSynchronousCommit:
    """Lock connections do not wait for the WAL flush of the registry write (a token
    cannot go back after a crash: see DEFAULT_SYNCHRONOUS_COMMIT)."""

    def setting_of_a_lock_connection(self, alias: str, name: str) -> str:
        backend = get_backend(alias)
        assert isinstance(backend, PostgresBackend)
        with lock(name, backend=alias) as lease:
            held = backend._held[lease.owner]
            return str(held.conn.execute("SHOW synchronous_commit").fetchone()[0])

    def test_off_by_default(self, name: str) -> None:
        assert self.setting_of_a_lock_connection("pg", name) == "off"

    @pytest.mark.parametrize("value", ["on", "remote_apply", None])
    def test_configurable(self, value: str | None, name: str, settings: object) -> None:
        with override_settings(
            DISTLOCKS_BACKENDS={
                "pgsync": {
                    "BACKEND": "distlocks.backends.postgres.PostgresBackend",
                    "OPTIONS": {"synchronous_commit": value},
                }
            }
        ):
            with connection.cursor() as cursor:
                cursor.execute("SHOW synchronous_commit")
                server = cursor.fetchone()[0]
            assert self.setting_of_a_lock_connection("pgsync", name) == (value or server)

    @pytest.mark.parametrize("value", ["of", True, 1, "on; DROP TABLE x"])
    def test_a_bad_value_is_a_check_error(self, value: object) -> None:
        config = {
            "default": {
                "BACKEND": "distlocks.backends.postgres.PostgresBackend",
                "OPTIONS": {"synchronous_commit": value},
            }
        }
        with override_settings(DISTLOCKS_BACKENDS=config):
            hints = [str(m.hint) for m in check_settings()]
        assert any("synchronous_commit" in hint for hint in hints), hints
