"""Every way Django writes a fenced row, on PostgreSQL, SQLite and MariaDB, with the
one outcome each must have (docs/fencing.md, "Every write path"): it carries a
token, it is refused with a clear error, or it is an explicit ``unfenced()`` bypass.

Each test runs on the three databases: PostgreSQL ("default"), the SQLite file of the
"sqlite" alias and the throwaway MariaDB of the ``mariadb`` fixture (skipped, saying
what to install, where there is none).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.models import F
from django.test import Client, override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_bakery import baker

from distlocks import fencing, lock
from distlocks.exceptions import FencedRowDeleted, FencingTokenRequired, StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.models import MAX_TOKEN
from tests.testapp.models import Account, Parcel

#: What a backend can issue, and the first token none can.
TOO_BIG = [MAX_TOKEN + 1, 2**63 - 1]

_DATABASES = [
    pytest.param("default", marks=pytest.mark.django_db(transaction=True), id="postgresql"),
    pytest.param(
        "sqlite", marks=pytest.mark.django_db(databases=["sqlite"], transaction=True), id="sqlite"
    ),
    pytest.param("mariadb", id="mariadb"),
]


class OneDatabase:
    """Routes every model to the database under test (the admin's tests)."""

    alias = "default"

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return self.alias

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return self.alias


@pytest.fixture(params=_DATABASES)
def using(request: pytest.FixtureRequest, django_db_blocker: Any) -> Iterator[str]:
    """The alias of each database in turn (with no Account row in it)."""
    alias = str(request.param)
    if alias == "default":
        request.getfixturevalue("pg_ready")
    elif alias == "mariadb":
        request.getfixturevalue("mariadb")  # pytest-django's marks know no such alias
    with django_db_blocker.unblock():
        Account._base_manager.using(alias).all().delete()
        yield alias
        if alias == "mariadb":
            Account._base_manager.using(alias).all().delete()


def account(using: str, token: int = 10, balance: int = 100) -> Account:
    obj = Account(owner="ann", balance=balance)
    obj.save(using=using, fencing_token=token)
    return obj


def stored(using: str, pk: Any, *fields: str) -> tuple[Any, ...] | None:
    row = Account._base_manager.using(using).filter(pk=pk).values_list(*fields).first()
    return None if row is None else tuple(row)


def raw(using: str, sql: str, params: list[Any] | None = None) -> None:
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(sql, params)


def table(using: str) -> str:
    return connections[using].ops.quote_name(Account._meta.db_table)


# -- save -----------------------------------------------------------------------------


class TestSave:
    def test_insert_needs_no_token_and_stores_the_one_given(self, using: str) -> None:
        plain = Account(owner="a")
        plain.save(using=using)
        given_ = account(using, 7)
        assert stored(using, plain.pk, "fencing_token") == (0,)
        assert stored(using, given_.pk, "fencing_token") == (7,)

    def test_update_carries_a_token_or_is_refused(self, using: str) -> None:
        obj = account(using, 10)
        obj.balance = 1
        with pytest.raises(FencingTokenRequired):
            obj.save(using=using)
        obj.save(using=using, fencing_token=11)
        assert stored(using, obj.pk, "balance", "fencing_token") == (1, 11)
        obj.balance = 2
        with pytest.raises(StaleFencingToken):
            obj.save(using=using, fencing_token=10)
        assert stored(using, obj.pk, "balance", "fencing_token") == (1, 11)

    def test_update_fields(self, using: str) -> None:
        obj = account(using, 10)
        obj.balance, obj.owner = 5, "bob"
        with pytest.raises(FencingTokenRequired):
            obj.save(using=using, update_fields=["balance"])
        obj.save(using=using, fencing_token=12, update_fields=["balance"])
        assert stored(using, obj.pk, "owner", "balance", "fencing_token") == ("ann", 5, 12)

    def test_unfenced_save_keeps_the_token_and_cannot_lower_it(self, using: str) -> None:
        obj = account(using, 10)
        stale = Account.objects.using(using).get(pk=obj.pk)
        obj.save(using=using, fencing_token=20)
        with unfenced():
            obj.balance = 3
            obj.save(using=using)
            stale.balance = 4
            with pytest.raises(StaleFencingToken):
                stale.save(using=using)
        assert stored(using, obj.pk, "balance", "fencing_token") == (3, 20)


class TestADeletedRowIsNotInsertedAgain:
    """Issue 24 item 2: a holder that loaded a row, paused, and saves after a newer
    holder deleted it, must not bring the row back."""

    def test_a_loaded_object_whose_row_is_gone(self, using: str) -> None:
        obj = account(using, 10)
        loaded = Account.objects.using(using).get(pk=obj.pk)
        obj.delete(using=using, fencing_token=20)  # the newer holder
        loaded.balance = 0
        with pytest.raises(FencedRowDeleted, match="deleted"):
            loaded.save(using=using, fencing_token=10)
        with pytest.raises(FencedRowDeleted):  # not even with a newer token
            loaded.save(using=using, fencing_token=30)
        assert stored(using, obj.pk, "balance") is None
        assert loaded.fencing_token == 10 and loaded.balance == 0

    def test_inside_the_rows_lock(self, using: str) -> None:
        obj = account(using, 0)
        with unfenced():
            Account.objects.using(using).filter(pk=obj.pk).delete()
        with pytest.raises(FencedRowDeleted), obj.fenced_lock():
            obj.save(using=using)
        assert stored(using, obj.pk, "balance") is None

    def test_a_new_object_with_its_pk_is_still_an_insert(self, using: str) -> None:
        obj = Account(pk=987654, owner="new")
        obj.save(using=using, fencing_token=5)
        assert stored(using, 987654, "owner", "fencing_token") == ("new", 5)


# -- QuerySet writes ----------------------------------------------------------------


class TestQuerySet:
    def test_update_with_and_without_f_is_refused(self, using: str) -> None:
        obj = account(using, 10)
        qs = Account.objects.using(using).filter(pk=obj.pk)
        with pytest.raises(FencingTokenRequired, match="fenced_update"):
            qs.update(balance=0)
        with pytest.raises(FencingTokenRequired, match="fenced_update"):
            qs.update(balance=F("balance") + 1)
        assert stored(using, obj.pk, "balance", "fencing_token") == (100, 10)

    def test_fenced_update_with_and_without_f(self, using: str) -> None:
        obj, newer = account(using, 10), account(using, 30)
        qs = Account.objects.using(using).filter(pk__in=[obj.pk, newer.pk])
        assert qs.fenced_update(20, balance=F("balance") + 1).stale == 1
        assert qs.fenced_update(20, owner="x").updated == 1
        assert stored(using, obj.pk, "owner", "balance", "fencing_token") == ("x", 101, 20)
        assert stored(using, newer.pk, "owner", "balance", "fencing_token") == ("ann", 100, 30)

    def test_unfenced_update_is_a_bypass_that_cannot_lower(self, using: str) -> None:
        obj = account(using, 10)
        qs = Account.objects.using(using).filter(pk=obj.pk)
        with unfenced():
            assert qs.update(balance=F("balance") - 1) == 1
            with pytest.raises(StaleFencingToken):
                qs.update(fencing_token=9)
        assert stored(using, obj.pk, "balance", "fencing_token") == (99, 10)

    def test_bulk_update(self, using: str) -> None:
        obj = account(using, 10)
        obj.balance = 1
        with pytest.raises(FencingTokenRequired):
            Account.objects.using(using).bulk_update([obj], ["balance"])
        obj.fencing_token = 5
        with unfenced(), pytest.raises(StaleFencingToken):
            Account.objects.using(using).bulk_update([obj], ["balance", "fencing_token"])
        assert stored(using, obj.pk, "balance", "fencing_token") == (100, 10)


class TestBulkCreate:
    def test_plain_insert_stores_each_objects_token(self, using: str) -> None:
        made = Account.objects.using(using).bulk_create(
            [Account(owner="a"), Account(owner="b", fencing_token=4)]
        )
        tokens = sorted(t for (t,) in Account.objects.using(using).values_list("fencing_token"))
        assert tokens == [0, 4] and len(made) == 2

    @pytest.mark.parametrize("bad", TOO_BIG)
    def test_plain_insert_of_a_token_no_backend_issues_is_refused(
        self, using: str, bad: int
    ) -> None:
        with pytest.raises(ValueError, match="fencing_token must be from 0 to"):
            Account.objects.using(using).bulk_create([Account(owner="a", fencing_token=bad)])
        assert not Account.objects.using(using).exists()

    def _upsert(self, using: str, pk: int, owner: str, **kwargs: Any) -> None:
        Account.objects.using(using).bulk_create(
            [Account(pk=pk, owner=owner, balance=0)],
            update_conflicts=True,
            update_fields=["owner", "balance"],
            # MySQL/MariaDB take no conflict target (any unique key conflicts).
            unique_fields=(
                ["id"]
                if connections[using].features.supports_update_conflicts_with_target
                else None
            ),
            **kwargs,
        )

    def test_upsert_without_a_token_is_refused(self, using: str) -> None:
        """Issue 24 item 1: it overwrote the row with no token at all."""
        obj = account(using, 20)
        with pytest.raises(FencingTokenRequired, match="update_conflicts"):
            self._upsert(using, obj.pk, "stale")
        assert stored(using, obj.pk, "owner", "balance", "fencing_token") == ("ann", 100, 20)

    def test_a_stale_upsert_writes_nothing(self, using: str) -> None:
        obj = account(using, 20)
        with pytest.raises(StaleFencingToken):
            self._upsert(using, obj.pk, "stale", fencing_token=10)
        assert stored(using, obj.pk, "owner", "balance", "fencing_token") == ("ann", 100, 20)
        assert Account.objects.using(using).count() == 1

    def test_an_upsert_with_a_current_token_writes_and_stores_it(self, using: str) -> None:
        obj = account(using, 20)
        self._upsert(using, obj.pk, "holder", fencing_token=20)
        self._upsert(using, 424242, "new", fencing_token=21)
        assert stored(using, obj.pk, "owner", "balance", "fencing_token") == ("holder", 0, 20)
        assert stored(using, 424242, "owner", "fencing_token") == ("new", 21)

    def test_an_async_upsert_takes_a_token_too(self, using: str) -> None:
        import asyncio

        from asgiref.sync import sync_to_async

        obj = account(using, 20)
        manager = Account.objects.using(using)
        features = connections[using].features
        kwargs: dict[str, Any] = {
            "update_conflicts": True,
            "update_fields": ["owner"],
            "unique_fields": ["id"] if features.supports_update_conflicts_with_target else None,
        }

        async def upserts() -> None:
            try:
                with pytest.raises(FencingTokenRequired):
                    await manager.abulk_create([Account(pk=obj.pk, owner="x")], **kwargs)
                with pytest.raises(StaleFencingToken):
                    await manager.abulk_create(
                        [Account(pk=obj.pk, owner="x")], fencing_token=5, **kwargs
                    )
                await manager.abulk_create(
                    [Account(pk=obj.pk, owner="y")], fencing_token=21, **kwargs
                )
            finally:  # the connections of the thread sync_to_async ran them in
                await sync_to_async(connections.close_all)()

        asyncio.run(asyncio.wait_for(upserts(), 60))
        assert stored(using, obj.pk, "owner", "fencing_token") == ("y", 21)

    def test_an_upsert_under_a_lease(self, using: str) -> None:
        obj = account(using, 20)
        with lock(obj.get_fencing_lock_name()) as lease:
            self._upsert(using, obj.pk, "leased", fencing_token=lease)
        assert stored(using, obj.pk, "owner", "fencing_token") == ("leased", lease.fencing_token)

    def test_unfenced_upsert_is_a_bypass(self, using: str) -> None:
        obj = account(using, 20)
        with unfenced():
            self._upsert(using, obj.pk, "maintenance")
        assert stored(using, obj.pk, "owner", "fencing_token") == ("maintenance", 20)


class TestCreateShortcuts:
    def test_get_or_create(self, using: str) -> None:
        obj, made = Account.objects.using(using).get_or_create(owner="a", defaults={"balance": 1})
        assert made and stored(using, obj.pk, "fencing_token") == (0,)
        again, made = Account.objects.using(using).get_or_create(owner="a")
        assert not made and again.pk == obj.pk

    def test_update_or_create(self, using: str) -> None:
        obj, made = Account.objects.using(using).update_or_create(
            owner="a", defaults={"balance": 1}
        )
        assert made
        with pytest.raises(FencingTokenRequired):
            Account.objects.using(using).update_or_create(owner="a", defaults={"balance": 2})
        with lock(obj.get_fencing_lock_name()) as lease:
            Account.objects.using(using).update_or_create(owner="a", defaults={"balance": 3})
        assert stored(using, obj.pk, "balance", "fencing_token") == (3, lease.fencing_token)

    def test_model_bakery(self, using: str) -> None:
        obj = baker.make(Account, owner="baked", _using=using)
        assert stored(using, obj.pk, "fencing_token") == (0,)
        with pytest.raises(ValueError, match="fencing_token"):
            baker.make(Account, fencing_token=2**63 - 1, _using=using)
        obj.balance = 5
        with pytest.raises(FencingTokenRequired):
            obj.save()


class TestDelete:
    def test_delete_needs_a_token(self, using: str) -> None:
        obj = account(using, 10)
        with pytest.raises(FencingTokenRequired):
            obj.delete(using=using)
        with pytest.raises(FencingTokenRequired, match="fenced_delete"):
            Account.objects.using(using).filter(pk=obj.pk).delete()
        assert stored(using, obj.pk, "fencing_token") == (10,)

    def test_a_stale_delete_keeps_the_row(self, using: str) -> None:
        obj = account(using, 20)
        with pytest.raises(StaleFencingToken):
            obj.delete(using=using, fencing_token=10)
        assert stored(using, obj.pk, "fencing_token") == (20,)
        assert obj.delete(using=using, fencing_token=20)[0] == 1
        assert stored(using, obj.pk, "fencing_token") is None

    def test_fenced_delete(self, using: str) -> None:
        old, newer = account(using, 10), account(using, 30)
        assert not hasattr(Account.objects, "fenced_delete")  # as delete(): .all() first
        assert not hasattr(Account.objects, "delete")
        result = Account.objects.using(using).all().fenced_delete(20)
        assert (result.updated, result.stale) == (1, 1)
        assert stored(using, old.pk, "fencing_token") is None
        assert stored(using, newer.pk, "fencing_token") == (30,)

    def test_a_cascade_is_not_fenced(self, using: str) -> None:
        """The documented gap: Django's collector sets the children's key to NULL with
        its own UPDATE, which carries no token and leaves theirs as it is."""
        owner = account(using, 10)
        parcel = Parcel(code="p", account=owner)
        parcel.save(using=using, fencing_token=50)
        owner.delete(using=using, fencing_token=10)
        row = Parcel._base_manager.using(using).values_list("account", "fencing_token")
        assert row.get(pk=parcel.pk) == (None, 50)
        with unfenced():
            Parcel.objects.using(using).all().delete()

    def test_unfenced_delete_is_a_bypass(self, using: str) -> None:
        obj = account(using, 10)
        with unfenced():
            Account.objects.using(using).filter(pk=obj.pk).delete()
        assert stored(using, obj.pk, "fencing_token") is None


# -- paths that bypass the ORM's checks: the database's trigger --------------------


class TestRawSQL:
    def test_lowering_is_refused(self, using: str) -> None:
        obj = account(using, 50)
        with pytest.raises(StaleFencingToken):
            raw(
                using,
                f"UPDATE {table(using)} SET fencing_token = 40, balance = 0 WHERE id = %s",
                [obj.pk],
            )
        assert stored(using, obj.pk, "balance", "fencing_token") == (100, 50)

    def test_an_update_leaving_the_token_passes(self, using: str) -> None:
        """Not stopped by the database (no strict mode: docs/fencing.md says why)."""
        obj = account(using, 50)
        raw(using, f"UPDATE {table(using)} SET balance = 1 WHERE id = %s", [obj.pk])
        assert stored(using, obj.pk, "balance", "fencing_token") == (1, 50)

    @pytest.mark.parametrize("bad", [*TOO_BIG, -1])
    def test_a_token_no_backend_issues_is_refused_on_insert(self, using: str, bad: int) -> None:
        with pytest.raises(DatabaseError, match="out of range"):
            raw(
                using,
                f"INSERT INTO {table(using)} (owner, balance, updated_at, fencing_token)"
                f" VALUES ('x', 0, %s, %s)",
                ["2026-01-01 00:00:00", bad],
            )
        assert not Account._base_manager.using(using).exists()

    @pytest.mark.parametrize("bad", TOO_BIG)
    def test_a_token_no_backend_issues_is_refused_on_update(self, using: str, bad: int) -> None:
        obj = account(using, 50)
        with pytest.raises(DatabaseError, match="out of range"):
            raw(using, f"UPDATE {table(using)} SET fencing_token = %s WHERE id = %s", [bad, obj.pk])
        assert stored(using, obj.pk, "fencing_token") == (50,)


@pytest.mark.parametrize("bad", TOO_BIG)
def test_create_refuses_a_token_no_backend_issues(using: str, bad: int) -> None:
    """Issue 24 item 3: such a row could never be written again."""
    with pytest.raises(ValueError, match="fencing_token must be from 0 to 9,007,199,254,740,991"):
        Account.objects.using(using).create(owner="a", fencing_token=bad)
    with unfenced(), pytest.raises(ValueError, match="fencing_token must be from 0"):
        Account.objects.using(using).create(owner="a", fencing_token=bad)
    obj = account(using, 10)
    for save in (
        lambda: obj.save(using=using, fencing_token=bad),
        lambda: Account.objects.using(using).fenced_update(bad, balance=0),
    ):
        with pytest.raises(ValueError, match="fencing_token must be from 0"):
            save()
    assert list(Account.objects.using(using).values_list("fencing_token", flat=True)) == [10]


@pytest.mark.parametrize("bad", TOO_BIG)
def test_a_row_with_a_token_out_of_range_can_be_repaired(using: str, bad: int) -> None:
    """A row stored before the range was checked: ``unfenced()`` lowers its token to
    the one of the row's lock, after which holders write it again."""
    connection = connections[using]
    with connection.cursor() as cursor:  # the insert trigger would refuse it
        for sql in fencing.drop_statements(connection, Account._meta.db_table):
            cursor.execute(sql)
    try:
        obj = account(using, 10)
        raw(using, f"UPDATE {table(using)} SET fencing_token = %s WHERE id = %s", [bad, obj.pk])
    finally:
        fencing.install_trigger(connection, Account._meta.db_table)
    with obj.fenced_lock() as lease:
        obj.balance = 1
        with pytest.raises(StaleFencingToken):
            obj.save(using=using)
        obj.refresh_from_db()
        with unfenced():  # the documented repair
            obj.fencing_token = lease.fencing_token
            obj.save(using=using, update_fields=["fencing_token"])
        obj.balance = 2
        obj.save(using=using)
    assert stored(using, obj.pk, "balance", "fencing_token") == (2, lease.fencing_token)
    # Once repaired, the token cannot go back up out of range, nor down.
    with pytest.raises(DatabaseError, match="out of range"):
        raw(using, f"UPDATE {table(using)} SET fencing_token = %s WHERE id = %s", [bad, obj.pk])
    with pytest.raises(StaleFencingToken):
        raw(using, f"UPDATE {table(using)} SET fencing_token = 1 WHERE id = %s", [obj.pk])


def test_sqlite_refuses_a_token_that_is_not_an_integer(using: str) -> None:
    """SQLite stores text in an integer column as it is, and text sorts above any
    integer: such a row would be fenced out for good."""
    if connections[using].vendor != "sqlite":
        pytest.skip("other databases convert the value to the column's type or refuse it")
    for value in ("'abc'", "12.5", "x'00'"):
        with pytest.raises(IntegrityError, match="must be an integer"):
            raw(
                using,
                f"INSERT INTO {table(using)} (owner, balance, updated_at, fencing_token)"
                f" VALUES ('x', 0, '2026-01-01', {value})",
            )
    assert not Account._base_manager.using(using).exists()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    stored_token=st.integers(0, MAX_TOKEN),
    offered=st.one_of(
        st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 0, MAX_TOKEN, MAX_TOKEN + 1])
    ),
)
def test_the_trigger_takes_exactly_in_range_tokens_not_below_the_stored_one(
    using: str, stored_token: int, offered: int
) -> None:
    obj = account(using, stored_token)
    sql = f"UPDATE {table(using)} SET fencing_token = %s WHERE id = %s"
    if not 0 <= offered <= MAX_TOKEN:
        with pytest.raises(DatabaseError, match="out of range"):
            raw(using, sql, [offered, obj.pk])
    elif offered < stored_token:
        with pytest.raises(StaleFencingToken):
            raw(using, sql, [offered, obj.pk])
    else:
        raw(using, sql, [offered, obj.pk])
    expected = offered if stored_token <= offered <= MAX_TOKEN else stored_token
    assert stored(using, obj.pk, "fencing_token") == (expected,)
    Account._base_manager.using(using).filter(pk=obj.pk).delete()


# -- loaddata and the admin -----------------------------------------------------------


def _fixture(tmp_path: Path, pk: int, owner: str, token: int) -> str:
    path = tmp_path / f"accounts-{owner}.json"
    path.write_text(
        json.dumps(
            [
                {
                    "model": "testapp.account",
                    "pk": pk,
                    "fields": {
                        "owner": owner,
                        "balance": 0,
                        "updated_at": "2026-01-01T00:00:00Z",
                        "fencing_token": token,
                    },
                }
            ]
        )
    )
    return str(path)


class TestLoaddata:
    """loaddata writes the fixture's token as it is (a raw save): the trigger
    refuses one that would lower a row's token or that no backend issues."""

    def test_a_new_row_takes_the_fixtures_token(self, using: str, tmp_path: Path) -> None:
        call_command("loaddata", _fixture(tmp_path, 5001, "new", 7), database=using, verbosity=0)
        assert stored(using, 5001, "owner", "fencing_token") == ("new", 7)

    def test_a_fixture_cannot_lower_a_rows_token(self, using: str, tmp_path: Path) -> None:
        obj = account(using, 20)
        with pytest.raises(StaleFencingToken):
            call_command(
                "loaddata", _fixture(tmp_path, obj.pk, "old", 3), database=using, verbosity=0
            )
        assert stored(using, obj.pk, "owner", "fencing_token") == ("ann", 20)

    def test_a_fixtures_token_out_of_range_is_refused(self, using: str, tmp_path: Path) -> None:
        with pytest.raises(DatabaseError, match="out of range"):
            call_command(
                "loaddata", _fixture(tmp_path, 5002, "big", 2**63 - 1), database=using, verbosity=0
            )
        assert stored(using, 5002, "owner") is None


@pytest.fixture
def staff(using: str) -> Iterator[Client]:
    """An admin client whose whole site (users, sessions, rows) is on ``using``."""
    OneDatabase.alias = using
    with override_settings(DATABASE_ROUTERS=[OneDatabase()]):
        user = User.objects.db_manager(using).create_superuser(
            f"admin-{using}", "a@example.com", "pw"
        )
        client = Client()
        client.force_login(user)
        yield client
        User.objects.db_manager(using).filter(pk=user.pk).delete()


class TestAdmin:
    def test_add_form_inserts_with_token_zero(self, using: str, staff: Client) -> None:
        response = staff.post("/admin/testapp/account/add/", {"owner": "added", "balance": 5})
        assert response.status_code == 302
        assert Account.objects.using(using).values_list("owner", "fencing_token").get() == (
            "added",
            0,
        )

    def test_change_form_saves_with_the_rows_lock(self, using: str, staff: Client) -> None:
        obj = account(using, 0)
        response = staff.post(
            f"/admin/testapp/account/{obj.pk}/change/", {"owner": "ann", "balance": 99}
        )
        assert response.status_code == 302
        balance, token = stored(using, obj.pk, "balance", "fencing_token") or (None, None)
        assert balance == 99 and token > 0
