"""Fenced writes: FencedModel, fenced_update, the database trigger, token durability."""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import signal
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import IntegrityError, connection, models, transaction
from django.db.models import F
from django.test import override_settings
from model_bakery import baker

from distlocks import get_backend, lock
from distlocks.checks import check_fenced_models
from distlocks.exceptions import (
    FencedRowDeleted,
    FencingTokenRequired,
    LockLost,
    StaleFencingToken,
)
from distlocks.fencing import unfenced
from distlocks.models import FencedModel
from distlocks.signals import fencing_rejected
from distlocks.testing.servers import RedisServer
from tests import workers
from tests.testapp.models import Account, Counter, Parcel, PlainCounter

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


def account(token: int = 10, **fields: object) -> Account:
    obj = Account(owner="ann", balance=100, **fields)
    obj.save(fencing_token=token)
    return obj


def test_insert_stores_the_token() -> None:
    obj = account(10)
    assert Account.objects.get(pk=obj.pk).fencing_token == 10
    assert obj.fencing_token == 10


def test_update_with_same_or_newer_token() -> None:
    obj = account(10)
    obj.balance = 50
    obj.save(fencing_token=10)
    obj.balance = 60
    obj.save(fencing_token=11)
    row = Account.objects.get(pk=obj.pk)
    assert (row.balance, row.fencing_token) == (60, 11)


def test_stale_token_is_rejected_and_nothing_changes() -> None:
    obj = account(10)
    stale_copy = Account.objects.get(pk=obj.pk)
    obj.balance = 70
    obj.save(fencing_token=20)
    before_updated_at = stale_copy.updated_at
    stale_copy.balance = 1
    with pytest.raises(StaleFencingToken) as excinfo:
        stale_copy.save(fencing_token=15)
    err = excinfo.value
    assert (err.model, err.pk, err.offered, err.stored) == (Account, obj.pk, 15, 20)
    row = Account.objects.get(pk=obj.pk)
    assert (row.balance, row.fencing_token) == (70, 20)
    # The instance is left as it was (auto_now included).
    assert stale_copy.fencing_token == 10
    assert stale_copy.updated_at == before_updated_at
    assert stale_copy.balance == 1


def test_rejection_sends_a_signal() -> None:
    seen: list[dict[str, object]] = []

    def receiver(sender: object, **kwargs: object) -> None:
        seen.append(kwargs)

    obj = account(10)
    Account.objects.filter(pk=obj.pk).fenced_update(20, balance=0)
    fencing_rejected.connect(receiver)
    try:
        with pytest.raises(StaleFencingToken):
            obj.save(fencing_token=12)
    finally:
        fencing_rejected.disconnect(receiver)
    assert seen[0]["offered"] == 12
    assert seen[0]["stored"] == 20


def test_update_fields_are_respected() -> None:
    obj = account(10)
    obj.balance = 5
    obj.owner = "bob"
    obj.save(fencing_token=11, update_fields=["balance"])
    row = Account.objects.get(pk=obj.pk)
    assert (row.owner, row.balance, row.fencing_token) == ("ann", 5, 11)


def test_save_of_a_deleted_row_does_not_insert_it_again() -> None:
    obj = account(10)
    with unfenced():
        Account.objects.filter(pk=obj.pk).delete()
    with pytest.raises(FencedRowDeleted, match="was deleted") as excinfo:
        obj.save(fencing_token=12)
    assert (excinfo.value.pk, excinfo.value.offered, excinfo.value.stored) == (obj.pk, 12, None)
    assert isinstance(excinfo.value, StaleFencingToken)
    assert not Account.objects.filter(pk=obj.pk).exists()


def test_bad_tokens_are_refused() -> None:
    obj = account(10)
    with pytest.raises(TypeError, match="int fencing token or a Lease"):
        obj.save(fencing_token="10")
    for bad in (-1, 2**53, 2**63, 10**400):
        with pytest.raises(ValueError, match="from 0 to 9,007,199,254,740,991"):
            obj.save(fencing_token=bad)
    assert Account.objects.get(pk=obj.pk).fencing_token == 10  # nothing written


class TestLeases:
    def test_save_with_a_lease(self, alias: str) -> None:
        obj = account(0)
        with obj.fenced_lock(backend=alias) as lease:
            obj.balance = 1
            obj.save(fencing_token=lease)
        assert Account.objects.get(pk=obj.pk).fencing_token == lease.fencing_token

    def test_save_inside_the_rows_lock_uses_its_token(self, alias: str) -> None:
        obj = account(0)
        assert obj.get_fencing_lock_name() == f"account:{obj.pk}"
        with lock(f"account:{obj.pk}", backend=alias) as lease:
            obj.balance = 2
            obj.save()  # no token passed: the active lease's
        assert Account.objects.get(pk=obj.pk).fencing_token == lease.fencing_token

    def test_decorated_function_saves_with_its_token(self, alias: str) -> None:
        obj = account(0)

        @lock(f"account:{obj.pk}", backend=alias)
        def pay() -> None:
            obj.balance -= 10
            obj.save()

        pay()
        row = Account.objects.get(pk=obj.pk)
        assert row.balance == 90
        assert row.fencing_token > 0

    def test_a_lease_known_lost_cannot_write(self, alias: str) -> None:
        obj = account(0)
        with (
            pytest.raises(LockLost),
            obj.fenced_lock(backend=alias, ttl=0.2, auto_renew=False) as lease,
        ):
            deadline = time.monotonic() + 5
            while lease.held():  # its local deadline passes: it is known lost
                assert time.monotonic() < deadline
                time.sleep(0.01)
            obj.balance = 0
            obj.save()
        assert Account.objects.get(pk=obj.pk).balance == 100

    def test_default_lock_name(self) -> None:
        counter = Counter(value=1)
        counter.save(fencing_token=1)
        assert counter.get_fencing_lock_name() == f"testapp.counter:{counter.pk}"


class TestEnforcement:
    def test_save_without_token_is_refused(self) -> None:
        obj = account(10)
        obj.balance = 0
        with pytest.raises(FencingTokenRequired, match="needs a fencing token"):
            obj.save()
        with lock("some-other-lock"), pytest.raises(FencingTokenRequired):
            obj.save()
        assert Account.objects.get(pk=obj.pk).balance == 100

    def test_update_after_an_insert_without_token_still_needs_one(self) -> None:
        obj = Account.objects.create(owner="x", balance=1)
        obj.balance = 2
        with pytest.raises(FencingTokenRequired):
            obj.save()
        loaded = Account.objects.get(pk=obj.pk)
        loaded.balance = 3
        with pytest.raises(FencingTokenRequired):
            loaded.save()
        assert Account.objects.get(pk=obj.pk).balance == 1


class TestInsertsNeedNoCeremony:
    """An INSERT overwrites nothing: new rows need no token (issue "Adoption")."""

    def test_create_and_friends_store_zero(self) -> None:
        created = Account.objects.create(owner="a")
        fetched, made = Account.objects.get_or_create(owner="b", defaults={"balance": 1})
        assert made
        baked = baker.make(Account, owner="c")
        plain = Account(owner="d")
        plain.save()
        for obj in (created, fetched, baked, plain):
            assert Account.objects.get(pk=obj.pk).fencing_token == 0
            assert obj.fencing_token == 0 and not obj._state.adding

    def test_a_given_token_is_stored(self) -> None:
        obj = Account.objects.create(owner="a", fencing_token=7)
        assert Account.objects.get(pk=obj.pk).fencing_token == 7
        obj = Account.objects.create(owner="z", fencing_token=0)
        assert Account.objects.get(pk=obj.pk).fencing_token == 0

    @pytest.mark.parametrize("bad", [-1, 2**63, "7", 1.5])
    def test_a_bad_token_value_writes_nothing(self, bad: Any) -> None:
        with pytest.raises((ValueError, TypeError), match="fencing_token"):
            Account.objects.create(owner="a", fencing_token=bad)
        assert not Account.objects.exists()

    def test_update_or_create_updates_only_with_a_token(self) -> None:
        obj, made = Account.objects.update_or_create(owner="a", defaults={"balance": 1})
        assert made and Account.objects.get(pk=obj.pk).fencing_token == 0
        with pytest.raises(FencingTokenRequired):
            Account.objects.update_or_create(owner="a", defaults={"balance": 2})
        assert Account.objects.get(pk=obj.pk).balance == 1
        with lock(f"account:{obj.pk}") as lease:
            Account.objects.update_or_create(owner="a", defaults={"balance": 3})
        stored = Account.objects.get(pk=obj.pk)
        assert (stored.balance, stored.fencing_token) == (3, lease.fencing_token)

    def test_a_new_instance_never_overwrites_an_existing_row(self) -> None:
        existing = account(10)
        intruder = Account(pk=existing.pk, owner="intruder", balance=0)
        with pytest.raises(IntegrityError), transaction.atomic():
            intruder.save()
        stored = Account.objects.get(pk=existing.pk)
        assert (stored.owner, stored.balance, stored.fencing_token) == ("ann", 100, 10)

    def test_an_insert_under_the_rows_lock_stores_its_token(self) -> None:
        with lock("account:424242") as lease:
            Account.objects.create(pk=424242, owner="a")
        assert Account.objects.get(pk=424242).fencing_token == lease.fencing_token

    def test_unfenced_inserts_as_before(self) -> None:
        with unfenced():
            obj = Account.objects.create(owner="a", fencing_token=5)
        assert Account.objects.get(pk=obj.pk).fencing_token == 5

    def test_queryset_update_needs_a_token(self) -> None:
        account(10)
        with pytest.raises(FencingTokenRequired, match="fenced_update"):
            Account.objects.update(balance=0)
        assert Account.objects.get().balance == 100

    def test_unfenced_escape_hatch(self) -> None:
        obj = account(10)
        with unfenced():
            Account.objects.update(balance=1)
            obj.refresh_from_db()
            obj.owner = "migrated"
            obj.save()
            baker.make(Account, owner="made")  # model-bakery works inside too
        row = Account.objects.get(pk=obj.pk)
        assert (row.owner, row.balance, row.fencing_token) == ("migrated", 1, 10)
        assert Account.objects.count() == 2

    def test_fenced_update_reports_stale_rows(self) -> None:
        old = account(10)
        new = account(30)
        result = Account.objects.filter(pk__in=[old.pk, new.pk]).fenced_update(20, balance=7)
        assert (result.updated, result.stale) == (1, 1)
        assert Account.objects.get(pk=old.pk).balance == 7
        assert Account.objects.get(pk=new.pk).balance == 100


class TestDatabaseTrigger:
    def test_trigger_is_installed_by_migrate(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " WHERE t.tgname = 'distlocks_fencing' ORDER BY 1"
            )
            tables = [row[0] for row in cursor.fetchall()]
        assert tables == ["testapp parcels", "testapp_account", "testapp_counter"]

    def test_raw_sql_cannot_lower_a_token(self) -> None:
        obj = account(50)
        with pytest.raises(StaleFencingToken) as excinfo, connection.cursor() as cursor:
            cursor.execute(
                "UPDATE testapp_account SET fencing_token = 40, balance = 0 WHERE id = %s",
                [obj.pk],
            )
        assert (excinfo.value.offered, excinfo.value.stored) == (40, 50)
        row = Account.objects.get(pk=obj.pk)
        assert (row.balance, row.fencing_token) == (100, 50)

    def test_raw_sql_may_raise_or_keep_the_token(self) -> None:
        obj = account(50)
        with connection.cursor() as cursor:
            cursor.execute("UPDATE testapp_account SET fencing_token = 60 WHERE id = %s", [obj.pk])
            cursor.execute("UPDATE testapp_account SET balance = 3 WHERE id = %s", [obj.pk])
        row = Account.objects.get(pk=obj.pk)
        assert (row.balance, row.fencing_token) == (3, 60)

    def test_unfenced_bulk_update_cannot_lower_either(self) -> None:
        account(50)
        with unfenced(), pytest.raises(StaleFencingToken):
            Account.objects.update(fencing_token=1)

    def test_migration_operation(self) -> None:
        from django.apps import apps
        from django.db.migrations.state import ProjectState

        from distlocks.operations import InstallFencingTrigger

        operation = InstallFencingTrigger("counter")
        state = ProjectState.from_apps(apps)
        with connection.schema_editor() as editor:
            operation.database_backwards("testapp", editor, state, state)
        assert not _has_trigger("testapp_counter")
        with connection.schema_editor() as editor:
            operation.database_forwards("testapp", editor, state, state)
        assert _has_trigger("testapp_counter")
        assert operation.deconstruct() == ("InstallFencingTrigger", ["counter"], {})


def _has_trigger(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
            " WHERE t.tgname = 'distlocks_fencing' AND c.relname = %s",
            [table],
        )
        return bool(cursor.fetchone()[0])


class TestModelCheck:
    @pytest.mark.django_isolate_apps("tests.testapp")
    def test_retyped_token_field_is_an_error(self, django_isolated_apps: Any) -> None:
        class Retyped(FencedModel):
            fencing_token = models.IntegerField(default=0)  # type: ignore[assignment]

            class Meta:
                app_label = "testapp"

        class Dropped(FencedModel):
            fencing_token = None  # type: ignore[assignment]

            class Meta:
                app_label = "testapp"

        class Nullable(FencedModel):
            fencing_token = models.BigIntegerField(null=True)  # type: ignore[assignment]

            class Meta:
                app_label = "testapp"

        class Fine(FencedModel):
            class Meta:
                app_label = "testapp"

        errors = check_fenced_models(list(django_isolated_apps.get_app_configs()))
        assert sorted((e.id, e.obj.__name__) for e in errors) == [
            ("distlocks.E010", "Dropped"),
            ("distlocks.E010", "Nullable"),
            ("distlocks.E010", "Retyped"),
        ]

    def test_real_models_pass(self) -> None:
        assert check_fenced_models() == []


# -- tokens never go backwards -----------------------------------------------------


def test_tokens_survive_a_redis_restart_that_lost_everything(own_redis: RedisServer) -> None:
    config = {"default": {"BACKEND": "distlocks.backends.redis.RedisBackend",
                          "LOCATION": own_redis.url}}  # fmt: skip
    with override_settings(DISTLOCKS_BACKENDS=config):
        obj = account(0)
        tokens = []
        for _ in range(3):
            with obj.fenced_lock() as lease:
                obj.save()
                tokens.append(lease.fencing_token)
        port = own_redis.port
        own_redis.kill()
        own_redis.start(port=port)  # empty: no persistence
        name = obj.get_fencing_lock_name()
        assert get_backend().fencing_counter(name) == 0  # the counter is gone...
        with obj.fenced_lock() as lease:
            obj.balance = 0
            obj.save()  # ...yet the new token is above every earlier one
        assert lease.fencing_token > max(tokens)
        assert Account.objects.get(pk=obj.pk).fencing_token == lease.fencing_token


def test_tokens_track_the_clock_floor(alias: str, name: str) -> None:
    before_us = time.time_ns() // 1000 - 2_000_000  # server and client share the machine
    with lock(name, backend=alias) as lease:
        pass
    assert lease.fencing_token >= before_us
    assert lease.fencing_token < 2**53  # exact in Lua doubles and JSON numbers


# -- the lost-update workload -------------------------------------------------------


def _run_workload(model: type[models.Model], name: str, work: Path) -> dict[str, object]:
    with unfenced():
        row = model.objects.create(value=0)
    label = model._meta.label
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(
        target=workers.paused_writer, args=(label, row.pk, "redis", name, str(work))
    )
    victim.start()
    deadline = time.monotonic() + 30
    while not (work / "ready").exists():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(victim.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    log = work / "log"
    others = [
        ctx.Process(
            target=workers.fenced_increments, args=(label, row.pk, "redis", name, 8, str(log))
        )
        for _ in range(3)
    ]
    for proc in others:
        proc.start()
    # Let the others get the expired lock and write a few times before resuming.
    while not log.exists() or len(log.read_text().split()) < 6:
        assert time.monotonic() < deadline + 30
        time.sleep(0.01)
    (work / "go").write_text("")
    os.kill(victim.pid, signal.SIGCONT)  # type: ignore[arg-type]
    victim.join(30)
    for proc in others:
        proc.join(60)
        assert proc.exitcode == 0
    outcomes = log.read_text().split()
    victim_outcome = (work / "outcome").read_text()
    successes = outcomes.count("ok") + (victim_outcome == "ok")
    return {
        "final": model.objects.get(pk=row.pk).value,
        "successes": successes,
        "victim": victim_outcome,
        "stale_others": outcomes.count("stale"),
    }


@pytest.mark.slow
def test_fenced_saves_lose_no_update_under_a_paused_holder(name: str, tmp_path: Path) -> None:
    result = _run_workload(Counter, name, tmp_path)
    assert str(result["victim"]).startswith("stale"), result
    assert result["final"] == result["successes"], result
    assert result["successes"] == 24, result


@pytest.mark.slow
def test_plain_saves_lose_updates_under_a_paused_holder(name: str, tmp_path: Path) -> None:
    """The control: without fencing, the resumed holder overwrites newer writes."""
    result = _run_workload(PlainCounter, name, tmp_path)
    assert result["victim"] == "ok"
    assert result["final"] < result["successes"], result


def test_timestamps_are_aware() -> None:
    obj = account(1)
    assert obj.updated_at.tzinfo is not None
    assert obj.updated_at <= dt.datetime.now(dt.UTC)


class TestTheFencedStatement:
    """The fenced UPDATE is built once per model and columns, and each value is prepared
    by its field as Django's own UPDATE would: quoted names, a UUID key, JSON, decimals,
    a foreign key; an F() expression goes through the ORM."""

    def parcel(self, **values: Any) -> Parcel:
        row = Parcel(code="P-1", **values)
        row.save(fencing_token=5)
        return row

    def test_values_of_every_kind_round_trip(self) -> None:
        owner = account(1)
        row = self.parcel()
        row.data = {"tags": ["a", "é"], "n": 1}
        row.weight = Decimal("12.345")
        row.account = owner
        row.code = "P-2"
        row.save(fencing_token=6)
        stored = Parcel.objects.get(pk=row.pk)
        assert (stored.code, stored.data, stored.weight, stored.account_id) == (
            "P-2", {"tags": ["a", "é"], "n": 1}, Decimal("12.345"), owner.pk,
        )  # fmt: skip
        assert stored.fencing_token == 6

    def test_a_stale_token_writes_nothing(self) -> None:
        row = self.parcel()
        row.code = "stale"
        with pytest.raises(StaleFencingToken):
            row.save(fencing_token=4)
        assert Parcel.objects.get(pk=row.pk).code == "P-1"
        with pytest.raises(StaleFencingToken):
            row.save(fencing_token=4, update_fields=["code"])
        assert Parcel.objects.get(pk=row.pk).code == "P-1"

    def test_raw_sql_lowering_the_token_is_refused_on_a_quoted_table(self) -> None:
        row = self.parcel()
        with pytest.raises(StaleFencingToken), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    'UPDATE "testapp parcels" SET fencing_token = 1 WHERE "parcel id" = %s',
                    [row.pk],
                )

    def test_an_expression_goes_through_the_orm(self) -> None:
        obj = account(10)
        obj.balance = F("balance") + 5
        obj.save(fencing_token=11)
        assert Account.objects.get(pk=obj.pk).balance == 105
        obj.balance = F("balance") + 5
        with pytest.raises(StaleFencingToken):
            obj.save(fencing_token=10)
        assert Account.objects.get(pk=obj.pk).balance == 105
