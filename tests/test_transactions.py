"""A lease released inside ``transaction.atomic()`` is freed when the transaction
commits or rolls back (issue 24, item 6), on every backend, with an opt-out."""

from __future__ import annotations

import logging
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test import Client, override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks import alock, get_backend, lock, lock_many, rwlock, semaphore, signals
from distlocks.exceptions import LockNotAcquired
from tests import transaction_workers
from tests.testapp.models import PlainCounter
from tests.waiting import wait_for, wait_for_text

pytestmark = pytest.mark.usefixtures("pg_ready")

#: Each test commits for real. On the function itself, as tests/conftest.py marks the
#: PostgreSQL-parametrized ones with a plain django_db (a TestCase transaction, which
#: never commits), and the marker nearest to the test wins.
TEST_ALIASES = ("default", "sqlite")
committing = pytest.mark.django_db(transaction=True, databases=list(TEST_ALIASES))


def taken_elsewhere(alias: str, name: str) -> bool:
    """Whether another thread can take ``name`` right now (it gives it back at once).
    Another thread: the releasing thread itself would get its own pending lease back."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            with lock(name, backend=alias, ttl=5, timeout=0, release_on_commit=False):
                result.append(True)
        except LockNotAcquired:
            result.append(False)
        finally:
            connections.close_all()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(60)
    assert result, "the other thread's attempt did not finish"
    return result[0]


class Released:
    """Records the leases the ``lock_released`` signal reports."""

    def __init__(self) -> None:
        self.leases: list[Any] = []

    def __call__(self, sender: Any, lease: Any, **kwargs: Any) -> None:
        self.leases.append(lease)


@pytest.fixture
def released() -> Any:
    receiver = Released()
    signals.lock_released.connect(receiver, weak=False)
    yield receiver
    signals.lock_released.disconnect(receiver)


@committing
def test_release_inside_atomic_waits_for_the_commit(alias: str, name: str, released: Any) -> None:
    with transaction.atomic():
        with lock(name, backend=alias, ttl=30) as lease:
            pass
        explicit = lock(f"{name}:explicit", backend=alias, ttl=30).acquire()
        assert explicit.release() is True  # accepted (code reading False as "lost" stays right)
        assert explicit.release_pending
        assert lease.held()
        assert lease.release_pending
        assert lease.state == "held"
        assert not taken_elsewhere(alias, name)
        assert released.leases == []
        assert lease.release() is False  # idempotent while pending: nothing more to do
    assert lease.state == explicit.state == "released"
    assert not lease.release_pending
    assert released.leases == [lease, explicit]
    assert taken_elsewhere(alias, name)


@committing
def test_rollback_releases_too(alias: str, name: str, released: Any) -> None:
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        with lock(name, backend=alias, ttl=30) as lease:
            pass
        assert lease.release_pending and not taken_elsewhere(alias, name)
        1 / 0  # noqa: B018
    assert lease.state == "released"
    assert released.leases == [lease]
    assert taken_elsewhere(alias, name)


@committing
def test_savepoint_rollback_keeps_the_lock_until_the_outer_transaction_ends(
    alias: str, name: str
) -> None:
    with transaction.atomic():
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            with lock(name, backend=alias, ttl=30) as lease:
                pass
            1 / 0  # noqa: B018
        # The savepoint rolled back; the outer transaction may still write under it.
        assert lease.held() and lease.release_pending
        assert not taken_elsewhere(alias, name)
        with transaction.atomic():  # a savepoint that commits changes nothing either
            pass
        assert lease.release_pending
    assert lease.state == "released"
    assert taken_elsewhere(alias, name)


@committing
@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_outside_a_transaction_the_release_is_immediate(alias: str, name: str) -> None:
    with lock(name, backend=alias, ttl=30) as lease:
        pass
    assert lease.state == "released" and not lease.release_pending


@committing
@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_opt_out_per_lock_and_by_setting(alias: str, name: str) -> None:
    with transaction.atomic():
        with lock(name, backend=alias, ttl=30, release_on_commit=False) as lease:
            pass
        assert lease.state == "released"
        assert taken_elsewhere(alias, name)
        with override_settings(DISTLOCKS_RELEASE_ON_COMMIT=False):
            with lock(name, backend=alias, ttl=30) as lease:
                pass
            assert lease.state == "released"
            # The argument wins over the setting.
            with lock(name, backend=alias, ttl=30, release_on_commit=True) as lease:
                pass
            assert lease.release_pending
    assert lease.state == "released"


@committing
def test_bad_opt_out_values_are_refused(name: str) -> None:
    with pytest.raises(TypeError, match="release_on_commit must be True or False"):
        lock(name, release_on_commit="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync_to_async"):
        alock(name, release_on_commit=True)
    alock(name, release_on_commit=False)  # accepted: what alock does anyway


@committing
@pytest.mark.parametrize("alias", ["locmem", "redis", "pg"])
def test_the_same_thread_taking_it_again_gets_its_lease_back(
    alias: str, name: str, released: Any
) -> None:
    """A view that locks the same name twice in one transaction must not wait for its
    own pending release (that would last until its timeout)."""
    with transaction.atomic():
        with lock(name, backend=alias, ttl=30, timeout=0) as first:
            pass
        with lock(name, backend=alias, ttl=30, timeout=0) as second:
            assert second is first and not second.release_pending
        assert first.release_pending
        with lock_many([name, f"{name}:b"], backend=alias, ttl=30, timeout=0) as both:
            assert both[name] is first
        assert not taken_elsewhere(alias, name)
    assert first.state == "released"
    assert [lease.name for lease in released.leases] == [f"{name}:b", name]
    assert taken_elsewhere(alias, name)


@committing
@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_reentrant_lock_inside_a_transaction(alias: str, name: str) -> None:
    with transaction.atomic():
        with lock(name, backend=alias, reentrant=True) as outer:
            with lock(name, backend=alias, reentrant=True) as inner:
                assert inner is outer
            assert not outer.release_pending  # an outer holder still holds it
        assert outer.release_pending
        with lock(name, backend=alias, reentrant=True) as again:  # taken back, once
            assert again is outer and not again.release_pending
        assert outer.release_pending
    assert outer.state == "released"
    assert taken_elsewhere(alias, name)


@committing
@pytest.mark.parametrize("alias", ["locmem", "redis", "pg"])
def test_semaphores_and_read_write_locks_wait_too(alias: str, name: str) -> None:
    with transaction.atomic():
        with semaphore(name, limit=1, backend=alias, ttl=30) as permit:
            pass
        assert permit.release_pending
        with semaphore(name, limit=1, backend=alias, ttl=30, timeout=0) as again:
            assert again is permit  # its own pending permit, handed back
        catalog = rwlock(f"{name}:rw", backend=alias)
        with catalog.read(ttl=30) as reader:
            pass
        assert reader.release_pending
        # The write side is another kind: it waits for the COMMIT (documented).
        with pytest.raises(LockNotAcquired):
            catalog.write(ttl=30, timeout=0).acquire()
    assert permit.state == reader.state == "released"
    with catalog.write(ttl=30, timeout=0), semaphore(name, limit=1, backend=alias, timeout=0):
        pass


@committing
@pytest.mark.parametrize("alias", ["locmem", "redis"])
def test_a_pending_lease_lost_meanwhile_is_reported_not_raised(alias: str, name: str) -> None:
    """Force-released while its release waits: leaving atomic() does not raise (the
    transaction has committed); the loss is reported as any loss is."""
    lost: list[Any] = []
    with transaction.atomic():
        with lock(name, backend=alias, ttl=30, on_lost=lost.append) as lease:
            pass
        assert get_backend(alias).force_release(name, lease.fencing_token)
        assert taken_elsewhere(alias, name)
    assert lease.state == "lost" and lost == [lease]
    assert "release" in lease.lost_reason


@committing
def test_a_pending_lease_is_still_renewed(name: str) -> None:
    with transaction.atomic():
        with lock(name, backend="redis", ttl=2) as lease:
            pass
        wait_for(lambda: lease.renewals >= 2, 60, "renewals while the release is pending")
        assert lease.held() and not taken_elsewhere("redis", name)
    assert lease.state == "released"


@pytest.mark.django_db
def test_inside_a_test_case_transaction_the_release_is_immediate(name: str) -> None:
    """Django's TestCase wraps each test in a transaction that never commits: waiting
    for it would keep every lock until the end of the test."""
    assert connection.in_atomic_block
    with lock(name, backend="locmem") as lease:
        pass
    assert lease.state == "released"
    with transaction.atomic():  # a savepoint of the same transaction: released too
        with lock(name, backend="locmem") as lease:
            pass
        assert lease.state == "released"


@committing
def test_postgres_transaction_mode_is_not_handled_twice(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its lock ends with the transaction by itself: release() answers at once."""
    with caplog.at_level(logging.WARNING), transaction.atomic():
        lease = lock(name, backend="pgx", timeout=0).acquire()
        assert lease.release() is True
        assert not lease.release_pending
        assert not taken_elsewhere("pg", name)  # the transaction still holds it
    assert taken_elsewhere("pg", name)
    assert caplog.records == []


@committing
def test_a_transaction_on_another_database_alias_counts(name: str) -> None:
    with transaction.atomic(using="sqlite"):
        with lock(name, backend="locmem") as lease:
            pass
        assert lease.release_pending
    assert lease.state == "released"


@committing
def test_every_open_transaction_must_end(name: str) -> None:
    with transaction.atomic(using="sqlite"):
        with transaction.atomic():
            with lock(name, backend="locmem") as lease:
                pass
        assert lease.release_pending  # "default" committed, "sqlite" is still open
    assert lease.state == "released"


@committing
def test_connections_a_thread_opens_later_are_seen(name: str) -> None:
    """The release path remembers, per thread, once every alias is initialized there:
    an alias first used after an earlier release, and a connection replaced later
    (Django's live server thread does it), still count."""
    seen: list[bool] = []

    def work() -> None:
        try:
            with lock(name, backend="locmem"):  # nothing initialized in this thread yet
                pass
            with transaction.atomic(using="sqlite"):  # the first use of "sqlite"
                with lock(name, backend="locmem") as lease:
                    pass
                seen.append(lease.release_pending)
            # Now every alias this test may use is initialized (a "mariadb" alias that
            # an earlier test of the session added is not this test's to open).
            for alias in TEST_ALIASES:
                with transaction.atomic(using=alias):
                    with lock(name, backend="locmem") as lease:
                        pass
                    seen.append(lease.release_pending)
            connections["sqlite"].close()
            connections["sqlite"] = connections.create_connection("sqlite")
            with transaction.atomic(using="sqlite"):
                with lock(name, backend="locmem") as lease:
                    pass
                seen.append(lease.release_pending)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert seen == [True] * (2 + len(TEST_ALIASES))


@committing
def test_a_connection_closed_inside_the_transaction_releases(name: str) -> None:
    """Django drops the transaction (and its commit hooks) with the connection."""
    with transaction.atomic():
        with lock(name, backend="locmem") as lease:
            pass
        assert lease.release_pending
        connection.close()
        assert lease.state == "released"
        assert taken_elsewhere("locmem", name)


@committing
@pytest.mark.urls("tests.transaction_urls")
@pytest.mark.parametrize("alias", ["locmem", "redis", "pg"])
def test_view_under_atomic_requests(alias: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    row = PlainCounter.objects.create(value=0)
    answer = Client().get(f"/increment/{row.pk}/", {"alias": alias, "name": name}).json()
    assert answer == {
        "in_atomic_block": True,
        "held": True,
        "pending": True,
        "taken_elsewhere": False,
    }
    assert taken_elsewhere(alias, name)  # freed after the COMMIT
    row.refresh_from_db()
    assert row.value == 1
    # A view that fails after its block: rolled back, and the lock freed.
    client = Client(raise_request_exception=False)
    failed = client.get(f"/increment/{row.pk}/", {"alias": alias, "name": name, "fail": 1})
    assert failed.status_code == 500
    assert taken_elsewhere(alias, name)
    row.refresh_from_db()
    assert row.value == 1


# -- any nesting of atomic blocks: the lock is held until the outermost one ends ---

# A block: commits or raises, and holds the lock's with-block or nested blocks.
blocks = st.recursive(
    st.tuples(st.booleans(), st.just("lock")),
    lambda inner: st.tuples(st.booleans(), st.lists(inner, min_size=1, max_size=3)),
    max_leaves=6,
)


class Boom(Exception):
    pass


def _run(block: Any, name: str, leases: list[Any]) -> None:
    commits, body = block
    try:
        with transaction.atomic():
            if body == "lock":
                with lock(name, backend="locmem", timeout=0) as lease:
                    leases.append(lease)
            else:
                for child in body:
                    _run(child, name, leases)
            for lease in leases:
                assert lease.held() and lease.release_pending
            if not commits:
                raise Boom
    except Boom:
        pass


@committing
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=st.lists(blocks, min_size=1, max_size=3))
def test_any_nesting_releases_exactly_at_the_outermost_end(program: list[Any]) -> None:
    """Run each top-level block as a transaction; inside, each "lock" leaf takes and
    releases a lock. Every lock must stay held until its top-level transaction ends
    (commit or rollback) and be free right after it."""
    name = f"nesting:{id(program)}"
    for top in program:
        leases: list[Any] = []
        _run(top, name, leases)
        assert connection.in_atomic_block is False
        for lease in leases:
            assert lease.state == "released", lease
        assert taken_elsewhere("locmem", name)


# -- two processes and a real database -------------------------------------------


def _texts(work: Path) -> dict[str, str]:
    """What the workers wrote, for a failure's message."""
    return {path.name: path.read_text() for path in sorted(work.iterdir())}


@committing
@pytest.mark.slow
def test_the_next_holder_reads_the_committed_row(
    shared_alias: str, name: str, tmp_path: Path
) -> None:
    """Process 1, inside atomic(), takes the lock, updates a row, leaves the with block
    and waits before its COMMIT. Process 2 waits for the lock: it must not get it
    before process 1's COMMIT, and then reads the committed value."""
    row = PlainCounter.objects.create(value=1)
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(
        target=transaction_workers.write_then_commit_later,
        args=(shared_alias, name, row.pk, 42, str(tmp_path)),
    )
    reader = ctx.Process(
        target=transaction_workers.wait_then_read, args=(shared_alias, name, row.pk, str(tmp_path))
    )
    writer.start()
    try:
        assert wait_for_text(tmp_path / "released", 120) == "held=True pending=True"
        reader.start()
        wait_for_text(tmp_path / "waiting", 120, "the reader to start waiting")
        # Released by the writer's with block, yet nobody else can take it...
        with pytest.raises(LockNotAcquired):
            lock(name, backend=shared_alias, ttl=5, timeout=0).acquire()
        # ...and the write is not visible yet.
        row.refresh_from_db()
        assert row.value == 1
        (tmp_path / "commit").write_text("go")
        read = wait_for_text(tmp_path / "read", 120)
        value, after_commit, token = read.split()
        assert (value, after_commit) == ("42", "True"), (read, _texts(tmp_path))
        assert int(token) > int((tmp_path / "token").read_text())
        assert wait_for_text(tmp_path / "committed", 120) == "released", _texts(tmp_path)
        assert (tmp_path / "committing").read_text().startswith("held=True"), _texts(tmp_path)
    finally:
        (tmp_path / "commit").write_text("go")
        for proc in (writer, reader):
            if proc.pid is not None:
                proc.join(120)
    assert writer.exitcode == 0 and reader.exitcode == 0
