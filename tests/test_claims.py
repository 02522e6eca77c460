"""Claims (distlocks.claims): a holder writes its token into the rows it will change
right after the lock is granted, so a paused earlier holder's late write is refused.

The same tests run on PostgreSQL ("default"), SQLite ("sqlite", a file) and MariaDB
(skipped, saying what to install, where there is none). The Celery proof, with a
SIGSTOPped worker process, is at the end.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import get_backend, lock
from distlocks.claims import claim
from distlocks.exceptions import LockLost, StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.signals import fencing_rejected
from tests.celery_workers import celery_workers, tails
from tests.testapp.models import Account, Counter, Parcel, PlainCounter
from tests.waiting import wait_for

ALIASES = [
    pytest.param("default", marks=pytest.mark.django_db(transaction=True)),
    pytest.param("sqlite", marks=pytest.mark.django_db(databases=["sqlite"], transaction=True)),
    # No django_db mark: the mariadb fixture adds the alias and opens database access.
    "mariadb",
]


@pytest.fixture
def db_alias(alias: str, request: pytest.FixtureRequest, django_db_blocker: Any) -> Iterator[str]:
    """The database alias of the test; MariaDB rows are deleted afterwards (its tests
    run outside pytest-django's flush)."""
    if alias != "mariadb":
        yield alias
        return
    request.getfixturevalue("mariadb")
    with django_db_blocker.unblock():
        yield alias
        with unfenced():
            for model in (Parcel, Account, Counter):
                model._base_manager.using(alias).all().delete()


def tokens(alias: str, *objs: Any) -> list[int]:
    return [type(o)._base_manager.using(alias).values_list("fencing_token", flat=True).get(pk=o.pk)
            for o in objs]  # fmt: skip


def account(alias: str, token: int, balance: int = 100, owner: str = "ann") -> Account:
    return Account.objects.using(alias).create(owner=owner, balance=balance, fencing_token=token)


each_database = pytest.mark.parametrize("alias", ALIASES)


@each_database
def test_an_instance_is_claimed_and_reloaded(alias: str, db_alias: str) -> None:
    row = account(alias, 5)
    stale_copy = Account.objects.using(alias).get(pk=row.pk)
    # Another holder (token 7) writes after this copy was loaded.
    Account.objects.using(alias).filter(pk=row.pk).fenced_update(7, balance=170)
    assert claim(12, stale_copy) == 1
    # The copy now shows what is stored under the claim, and the row holds the token.
    assert (stale_copy.balance, stale_copy.fencing_token) == (170, 12)
    assert tokens(alias, row) == [12]
    # An equal token claims again (a holder may claim more than once).
    assert claim(12, stale_copy) == 1


@each_database
def test_a_late_write_of_an_earlier_holder_is_refused_after_the_claim(
    alias: str, db_alias: str
) -> None:
    row = account(alias, 1)
    earlier = Account.objects.using(alias).get(pk=row.pk)  # token 5's read
    later = Account.objects.using(alias).get(pk=row.pk)
    claim(9, later)
    earlier.balance += 1
    with pytest.raises(StaleFencingToken):
        earlier.save(fencing_token=5)
    later.balance += 10
    later.save(fencing_token=9)
    assert Account.objects.using(alias).get(pk=row.pk).balance == 110


@each_database
def test_a_newer_token_anywhere_claims_nothing(alias: str, db_alias: str) -> None:
    free, newer, other = account(alias, 3), account(alias, 50), account(alias, 4, owner="bob")
    seen: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        seen.append(kwargs)

    fencing_rejected.connect(record)
    try:
        with pytest.raises(StaleFencingToken) as raised:
            claim(10, free, Account.objects.using(alias).filter(pk=other.pk), newer)
    finally:
        fencing_rejected.disconnect(record)
    assert (raised.value.pk, raised.value.offered, raised.value.stored) == (newer.pk, 10, 50)
    assert "nothing was claimed" in str(raised.value)
    assert seen and seen[0]["offered"] == 10 and seen[0]["stored"] == 50
    assert tokens(alias, free, newer, other) == [3, 50, 4]  # all or none
    # The instances given were left as they were.
    assert (free.fencing_token, newer.fencing_token) == (3, 50)


@each_database
def test_a_queryset_claims_every_row_it_matches(alias: str, db_alias: str) -> None:
    rows = [account(alias, t, owner=o) for t, o in ((1, "ann"), (8, "ann"), (2, "bob"))]
    anns = Account.objects.using(alias).filter(owner="ann")
    assert claim(8, anns) == 2
    assert tokens(alias, *rows) == [8, 8, 2]
    assert claim(8, Account.objects.using(alias).filter(owner="nobody")) == 0
    with pytest.raises(StaleFencingToken) as raised:
        claim(5, Account.objects.using(alias).all())
    assert raised.value.stored == 8 and "and 1 more" in str(raised.value)
    assert tokens(alias, *rows) == [8, 8, 2]  # bob's row was not claimed either


@each_database
def test_a_deleted_row_is_an_error_and_nothing_is_claimed(alias: str, db_alias: str) -> None:
    kept, gone = account(alias, 1), account(alias, 1, owner="bob")
    with unfenced():
        Account._base_manager.using(alias).filter(pk=gone.pk).delete()
    with pytest.raises(Account.DoesNotExist, match="deleted since it was loaded"):
        claim(6, kept, gone)
    assert tokens(alias, kept) == [1]


@each_database
def test_rows_of_several_models_and_odd_columns(alias: str, db_alias: str) -> None:
    owner = account(alias, 1)
    parcel = Parcel.objects.using(alias).create(code="p", account=owner, fencing_token=2)
    counter = Counter.objects.using(alias).create(value=3)
    # The same row twice (two copies) is one row.
    twin = Account.objects.using(alias).get(pk=owner.pk)
    assert claim(40, owner, parcel, counter, twin) == 3
    assert tokens(alias, owner, parcel, counter) == [40, 40, 40]
    assert parcel.fencing_token == twin.fencing_token == 40


@each_database
def test_bad_targets_say_what_to_pass(alias: str, db_alias: str) -> None:
    row = account(alias, 1)
    with pytest.raises(TypeError, match="at least one target"):
        claim(3)
    with pytest.raises(TypeError, match="is not one"):
        claim(3, PlainCounter(pk=1))
    with pytest.raises(TypeError, match="not str"):
        claim(3, "account:1")
    with pytest.raises(ValueError, match="no primary key"):
        claim(3, Account(owner="new"))
    with pytest.raises(TypeError, match="sliced"):
        claim(3, Account.objects.using(alias).all()[:1])
    with pytest.raises(TypeError, match="fencing token or a Lease"):
        claim("3", row)
    assert tokens(alias, row) == [1]


@each_database
def test_a_lease_claims_with_its_token_and_a_lost_one_claims_nothing(
    alias: str, db_alias: str
) -> None:
    row = account(alias, 0)
    name = f"claims:{uuid.uuid4().hex}"
    with lock(name, backend="locmem", ttl=30) as lease:
        assert lease.claim(row) == 1
        assert row.fencing_token == lease.fencing_token > 0
    with pytest.raises(LockLost):
        lease.claim(row)  # released: it is no longer held


@each_database
@hsettings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), min_size=1, max_size=14))
def test_claimed_holders_never_write_from_a_stale_read(
    alias: str, db_alias: str, steps: list[tuple[bool, int]]
) -> None:
    """Holders come with ever larger tokens (each after the one before lost its lease),
    claim the counter and read it; any of them may write read + 1 at any later time.
    An accepted write was always computed from the value stored when it landed: no
    lost update, whatever the interleaving."""
    counter = Counter.objects.using(alias).create(value=0)
    holders: list[tuple[int, int]] = []  # (token, value read)
    accepted = 0
    for new, pick in steps:
        if new or not holders:
            token = len(holders) + 1
            row = Counter.objects.using(alias).get(pk=counter.pk)
            claim(token, row)
            holders.append((token, row.value))
            continue
        index = pick % len(holders)
        token, read = holders[index]
        before = Counter.objects.using(alias).get(pk=counter.pk).value
        row = Counter(pk=counter.pk, value=read + 1)
        row._state.db, row._state.adding = alias, False
        try:
            row.save(fencing_token=token, using=alias)
        except StaleFencingToken:
            continue
        accepted += 1
        assert read == before, "a write computed from an outdated read was accepted"
        holders[index] = (token, read + 1)  # the holder knows what it wrote
    assert Counter.objects.using(alias).get(pk=counter.pk).value == accepted


@each_database
def test_without_the_claim_the_same_interleaving_loses_an_update(alias: str, db_alias: str) -> None:
    """The control: the holders of the test above, reading without claiming."""
    counter = Counter.objects.using(alias).create(value=0)
    a_read = Counter.objects.using(alias).get(pk=counter.pk).value  # A (token 1), paused
    b_row = Counter.objects.using(alias).get(pk=counter.pk)  # B (token 2) reads
    a_row = Counter.objects.using(alias).get(pk=counter.pk)
    a_row.value = a_read + 1
    a_row.save(fencing_token=1)  # A wakes up: accepted, nothing newer was written
    b_row.value += 1
    b_row.save(fencing_token=2)  # accepted too, computed from B's read before A's write
    assert Counter.objects.using(alias).get(pk=counter.pk).value == 1  # two writes, +1


# -- the proof on real Celery workers -------------------------------------------------


@pytest.fixture(scope="module")
def claim_workers(pg_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two prefork workers (one process each) of tests.claim_celery_app, one per queue:
    the frozen holder's and its successor's."""
    from tests.claim_celery_app import app

    logs = tmp_path_factory.mktemp("claim-workers")
    queues = [(queue, ["--concurrency", "1", "-Q", queue]) for queue in ("claims-a", "claims-b")]
    with celery_workers(app, "tests.claim_celery_app", logs, queues):
        yield logs


def _report(client: redis.Redis, key: str, logs: Path) -> bytes:
    """The next report a task step pushed to ``key`` (waited for, with a deadline)."""
    reply = client.blpop([key], timeout=90)
    assert reply is not None, f"no {key} within 90 s\n{tails(logs)}"
    return bytes(reply[1])


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("use_claim", [True, False], ids=["claimed", "not-claimed"])
def test_a_frozen_task_cannot_overwrite_its_successors_work(
    claim_workers: Path, redis_client: redis.Redis, use_claim: bool
) -> None:
    """Task A (ttl 2 s, renewed) reads the counter, and its worker process is frozen
    (SIGSTOP) until its lease has expired; task B takes the lock and reads; A is
    resumed and writes read + 1, then B writes read + 10.

    With the claim, A's write is refused and B's value stands (10). Without it, both
    writes are accepted and A's increment is lost (the control: 10 instead of 11)."""
    from tests import claim_tasks

    run = uuid.uuid4().hex
    counter = Counter.objects.create(value=0)
    name = claim_tasks.increment.lock_name((run, "A", counter.pk, 1, use_claim))
    claim_tasks.increment.apply_async((run, "A", counter.pk, 1, use_claim), queue="claims-a")
    a = json.loads(_report(redis_client, f"{run}:A:read", claim_workers))
    os.kill(a["pid"], signal.SIGSTOP)
    try:
        # Frozen, its renewals stop: the lease runs out on the server.
        wait_for(lambda: get_backend().inspect(name) is None, limit=60, what="A's lease to end")
        claim_tasks.increment.apply_async((run, "B", counter.pk, 10, use_claim), queue="claims-b")
        b = json.loads(_report(redis_client, f"{run}:B:read", claim_workers))
        assert b["token"] > a["token"]
    finally:
        os.kill(a["pid"], signal.SIGCONT)
    redis_client.rpush(f"{run}:A:go", 1)
    a_outcome = _report(redis_client, f"{run}:A:done", claim_workers)
    redis_client.rpush(f"{run}:B:go", 1)
    b_outcome = _report(redis_client, f"{run}:B:done", claim_workers)
    counter.refresh_from_db()
    if use_claim:
        assert (a_outcome, b_outcome, counter.value) == (b"stale", b"ok", 10)
        assert counter.fencing_token == b["token"]
    else:
        # The lost update the claim prevents: A's +1 was accepted, then overwritten.
        assert (a_outcome, b_outcome, counter.value) == (b"ok", b"ok", 10)
