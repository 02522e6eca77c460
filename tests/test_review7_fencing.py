"""Review 7: write paths of a fenced row that the matrix (tests/test_fencing_matrix.py)
did not try, on PostgreSQL, SQLite and MariaDB.

* A reverse foreign key's related manager, ``account.parcel_set.add(parcel)``: with
  ``bulk=True`` (Django's default) it updated the fenced rows through the model's
  *base* manager, a plain ``QuerySet`` whose ``update()`` is not refused, and the
  trigger does not fire (the token column is not written). A fenced row was written
  with no token, outside ``unfenced()``.
* ``qs[:1] | qs``: Django rebuilds a sliced left operand from the base manager, so the
  union was a plain ``QuerySet`` whose ``update()`` ran without a token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections

from distlocks import lock
from distlocks.exceptions import FencingTokenRequired, StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.models import FencedQuerySet
from tests.testapp.models import Account, Parcel

_DATABASES = [
    pytest.param("default", marks=pytest.mark.django_db(transaction=True), id="postgresql"),
    pytest.param(
        "sqlite", marks=pytest.mark.django_db(databases=["sqlite"], transaction=True), id="sqlite"
    ),
    pytest.param("mariadb", id="mariadb"),
]


@pytest.fixture(params=_DATABASES)
def using(request: pytest.FixtureRequest, django_db_blocker: Any) -> Iterator[str]:
    """Each database in turn, with no Account or Parcel rows in it."""
    alias = str(request.param)
    if alias == "default":
        request.getfixturevalue("pg_ready")
    elif alias == "mariadb":
        request.getfixturevalue("mariadb")
    with django_db_blocker.unblock():
        for model in (Parcel, Account):
            model._base_manager.using(alias).all().delete()
        yield alias
        if alias == "mariadb":
            for model in (Parcel, Account):
                model._base_manager.using(alias).all().delete()


def _parcel(using: str, token: int) -> Parcel:
    parcel = Parcel(code="p")
    parcel.save(using=using, fencing_token=token)
    return Parcel.objects.using(using).get(pk=parcel.pk)


def _row(using: str, parcel: Parcel) -> tuple[Any, ...]:
    row = Parcel._base_manager.using(using).filter(pk=parcel.pk)
    return tuple(row.values_list("account_id", "fencing_token").get())


class TestReverseForeignKeyAdd:
    def test_a_bulk_add_is_refused_and_writes_nothing(self, using: str) -> None:
        owner = Account(owner="ann")
        owner.save(using=using, fencing_token=5)
        parcel = _parcel(using, 50)
        with pytest.raises(FencingTokenRequired, match="bulk=False"):
            owner.parcel_set.add(parcel)
        with pytest.raises(FencingTokenRequired):
            owner.parcel_set.set([parcel])
        assert _row(using, parcel) == (None, 50)

    def test_add_without_bulk_carries_each_rows_lease(self, using: str) -> None:
        owner = Account(owner="ann")
        owner.save(using=using, fencing_token=5)
        parcel = _parcel(using, 50)
        with pytest.raises(FencingTokenRequired):
            owner.parcel_set.add(parcel, bulk=False)  # no lock held on the parcel
        assert _row(using, parcel) == (None, 50)
        with lock(parcel.get_fencing_lock_name(), backend="locmem", ttl=30) as lease:
            owner.parcel_set.add(parcel, bulk=False)
        assert _row(using, parcel) == (owner.pk, lease.fencing_token)

    def test_inside_unfenced_a_bulk_add_is_djangos(self, using: str) -> None:
        owner = Account(owner="ann")
        owner.save(using=using, fencing_token=5)
        parcel = _parcel(using, 50)
        with unfenced():
            owner.parcel_set.add(parcel)
        assert _row(using, parcel) == (owner.pk, 50)

    def test_create_through_the_relation_is_an_insert(self, using: str) -> None:
        owner = Account(owner="ann")
        owner.save(using=using, fencing_token=5)
        created = owner.parcel_set.create(code="new")
        assert _row(using, created) == (owner.pk, 0)


class TestCombinedQuerySets:
    @pytest.mark.parametrize("operator", ["or", "xor"])
    def test_a_sliced_operand_keeps_the_refusal(self, using: str, operator: str) -> None:
        obj = Account(owner="ann", balance=1)
        obj.save(using=using, fencing_token=7)
        rows = Account.objects.using(using)
        left, right = rows.all()[:1], rows.filter(owner="nobody")
        combined = left | right if operator == "or" else left ^ right
        assert isinstance(combined, FencedQuerySet)
        with pytest.raises(FencingTokenRequired):
            combined.update(balance=77)
        assert rows.values_list("balance", "fencing_token").get() == (1, 7)
        if not connections[using].features.allow_sliced_subqueries_with_in:
            return  # MariaDB runs no sliced subquery: Django's own limit
        assert combined.fenced_update(9, balance=2).updated == 1
        assert rows.values_list("balance", "fencing_token").get() == (2, 9)


class TestUpsertNamingTheTokenColumn:
    """``update_fields`` naming ``fencing_token`` itself, with ``fencing_token=``: the
    column was added a second time, and PostgreSQL refused the statement ("multiple
    assignments to same column")."""

    def test_the_token_column_is_written_once(self, using: str) -> None:
        obj = Account(owner="ann", balance=1)
        obj.save(using=using, fencing_token=5)
        target = {}
        if connections[using].features.supports_update_conflicts_with_target:
            target["unique_fields"] = ["id"]
        rows = Account.objects.using(using)
        rows.bulk_create(
            [Account(pk=obj.pk, owner="ann", balance=3)],
            update_conflicts=True,
            update_fields=["balance", "fencing_token"],
            fencing_token=9,
            **target,
        )
        assert rows.values_list("balance", "fencing_token").get() == (3, 9)
        with pytest.raises(StaleFencingToken):
            rows.bulk_create(
                [Account(pk=obj.pk, owner="ann", balance=4)],
                update_conflicts=True,
                update_fields=("fencing_token", "balance"),
                fencing_token=8,
                **target,
            )
        assert rows.values_list("balance", "fencing_token").get() == (3, 9)


class TestAnUpdateOfAnUnsavedObject:
    """``save(update_fields=..., fencing_token=...)`` of an object with no primary key
    is refused as Django refuses it, not as a forced insert ("Cannot force both
    insert and updating"), and writes nothing."""

    @pytest.mark.parametrize("forced", [{"update_fields": ["owner"]}, {"force_update": True}])
    def test_it_says_there_is_no_primary_key(self, using: str, forced: dict[str, Any]) -> None:
        obj = Account(owner="ann")
        with pytest.raises(ValueError, match="no primary key"):
            obj.save(using=using, fencing_token=5, **forced)
        assert obj.pk is None and obj.fencing_token == 0
        assert not Account.objects.using(using).exists()


# -- a forked child that inherited the lease ---------------------------------------------


def _child_writes(obj: Account, lease: Any) -> dict[str, str]:
    """Every fenced write path a forked child could take with the lease it inherited
    (found in the context, or passed): the name of what each raised."""
    rows = Account.objects.using("sqlite").filter(pk=obj.pk)
    attempts: dict[str, Any] = {
        "save in the block": lambda: obj.save(using="sqlite"),
        "save with the lease": lambda: obj.save(using="sqlite", fencing_token=lease),
        "update_fields": lambda: obj.save(
            using="sqlite", fencing_token=lease, update_fields=["balance"]
        ),
        "fenced_update": lambda: rows.fenced_update(lease, balance=1),
        "fenced_delete": lambda: rows.fenced_delete(lease),
        "delete in the block": lambda: obj.delete(using="sqlite"),
        "claim": lambda: lease.claim(obj),
        "upsert": lambda: Account.objects.using("sqlite").bulk_create(
            [Account(pk=obj.pk, owner="child")],
            update_conflicts=True,
            update_fields=["owner"],
            unique_fields=["id"],
            fencing_token=lease,
        ),
    }
    outcome = {}
    for what, attempt in attempts.items():
        try:
            attempt()
            outcome[what] = "written"
        except Exception as exc:
            outcome[what] = type(exc).__name__
    return outcome


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.django_db(databases=["sqlite"], transaction=True)
def test_a_forked_child_cannot_write_with_its_parents_lease() -> None:
    """The fork rule on the storage side: every fenced write in the child refuses
    the inherited lease (LockLost) before any SQL, found in the context or passed."""
    obj = Account(owner="ann", balance=10)
    obj.save(using="sqlite", fencing_token=3)
    obj.refresh_from_db(using="sqlite")
    with lock(obj.get_fencing_lock_name(), backend="locmem", ttl=60) as lease:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running the parent's code
            try:
                os.close(read)
                obj.balance = 99
                os.write(write, json.dumps(_child_writes(obj, lease)).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as reader:
            report = json.loads(reader.read() or "{}")
        os.waitpid(pid, 0)
        assert report and set(report.values()) == {"LockLost"}, report
        assert lease.held()
    row = Account.objects.using("sqlite").values_list("owner", "balance", "fencing_token")
    assert row.get() == ("ann", 10, 3)


# -- shared leases are not the row's lock ------------------------------------------------


@pytest.mark.parametrize("shared", ["semaphore", "read"])
def test_a_shared_lease_on_the_rows_name_does_not_fence_a_save(using: str, shared: str) -> None:
    """A semaphore permit or a read lease named like the row carries token 0 and is
    held by several holders at once: a save inside it without a token is refused
    (FencingTokenRequired), as inside any other lock. It was taken as the row's lease,
    and with a row at token 0 (created without one, as the admin's add form does) two
    permit holders' saves both landed."""
    from distlocks import rwlock, semaphore

    obj = Account(owner="ann", balance=1)
    obj.save(using=using)  # an insert without a token: token 0
    name = obj.get_fencing_lock_name()
    side = (
        semaphore(name, limit=2, backend="locmem", ttl=30)
        if shared == "semaphore"
        else rwlock(name, backend="locmem").read(ttl=30)
    )
    with side:
        obj.balance = 2
        with pytest.raises(FencingTokenRequired):
            obj.save(using=using)
        with pytest.raises(FencingTokenRequired):
            obj.delete(using=using)
    assert Account.objects.using(using).values_list("balance", "fencing_token").get() == (1, 0)
    with rwlock(name, backend="locmem").write(ttl=30) as lease:  # the exclusive side counts
        obj.save(using=using)
    row = Account.objects.using(using).values_list("balance", "fencing_token").get()
    assert row == (2, lease.fencing_token)
