"""Fencing enforced inside SQLite: a trigger installed by migrate and by
InstallFencingTrigger refuses an UPDATE that lowers a row's token, whatever path
the statement took, and its error is StaleFencingToken on Django's connections.

Runs on the "sqlite" alias of tests/settings.py: a file database, so that worker
processes of the lost-update workload share it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connections, models, transaction
from django.db.migrations.state import ModelState, ProjectState

from distlocks.exceptions import StaleFencingToken
from distlocks.fencing import unfenced
from distlocks.operations import InstallFencingTrigger
from tests import fencing_workers
from tests.testapp.models import Account, Counter, Parcel

DB = "sqlite"

# Committed rows (worker processes read them) and schema changes, which SQLite's
# schema editor makes outside a transaction only.
pytestmark = pytest.mark.django_db(databases=[DB], transaction=True)


def _all_triggers() -> list[tuple[str, str]]:
    with connections[DB].cursor() as cursor:
        cursor.execute(
            "SELECT tbl_name, name FROM sqlite_master WHERE type = 'trigger'"
            " AND name LIKE 'distlocks%' ORDER BY 1, 2"
        )
        return list(cursor.fetchall())


def triggers() -> dict[str, str]:
    """Table -> the name of its distlocks update trigger."""
    return {t: n for t, n in _all_triggers() if not n.startswith("distlocks_fencing_insert")}


def insert_triggers() -> dict[str, str]:
    """Table -> the name of its distlocks insert trigger."""
    return {t: n for t, n in _all_triggers() if n.startswith("distlocks_fencing_insert")}


def execute(sql: str, params: list[Any] | None = None) -> None:
    with transaction.atomic(using=DB), connections[DB].cursor() as cursor:
        cursor.execute(sql, params)


def account(token: int, balance: int = 100) -> Account:
    return Account.objects.using(DB).create(owner="ann", balance=balance, fencing_token=token)


def stored(obj: models.Model, *fields: str) -> tuple[Any, ...]:
    return tuple(type(obj)._base_manager.using(DB).values_list(*fields).get(pk=obj.pk))


def test_the_database_is_a_sqlite_file() -> None:
    connection = connections[DB]
    assert connection.vendor == "sqlite"
    assert Path(connection.settings_dict["NAME"]).is_file()


class TestTheTrigger:
    def test_migrate_installs_it_on_every_fenced_table(self) -> None:
        assert triggers() == {
            "testapp parcels": "distlocks_fencing_testapp parcels",
            "testapp_account": "distlocks_fencing_testapp_account",
            "testapp_counter": "distlocks_fencing_testapp_counter",
        }
        assert insert_triggers() == {
            "testapp parcels": "distlocks_fencing_insert_testapp parcels",
            "testapp_account": "distlocks_fencing_insert_testapp_account",
            "testapp_counter": "distlocks_fencing_insert_testapp_counter",
        }

    def test_raw_sql_cannot_lower_a_token(self) -> None:
        obj = account(12)
        with pytest.raises(StaleFencingToken) as excinfo:
            execute(
                "UPDATE testapp_account SET fencing_token = 3, balance = 0 WHERE id = %s",
                [obj.pk],
            )
        assert excinfo.value.model == "testapp_account"
        assert "testapp_account" in str(excinfo.value)
        assert isinstance(excinfo.value.__cause__, IntegrityError)
        assert stored(obj, "balance", "fencing_token") == (100, 12)

    def test_raw_sql_cannot_lower_it_on_a_table_and_column_needing_quotes(self) -> None:
        parcel = Parcel(code="P-1")
        parcel.save(using=DB, fencing_token=12)
        with pytest.raises(StaleFencingToken) as excinfo:
            execute(
                'UPDATE "testapp parcels" SET fencing_token = 3, "Parcel Code" = %s'
                ' WHERE "parcel id" = %s',
                ["stale", parcel.pk.hex],
            )
        assert excinfo.value.model == "testapp parcels"
        assert stored(parcel, "code", "fencing_token") == ("P-1", 12)

    def test_an_equal_or_higher_token_and_other_columns_pass(self) -> None:
        obj = account(12)
        execute(
            "UPDATE testapp_account SET fencing_token = 12, balance = 1 WHERE id = %s", [obj.pk]
        )
        assert stored(obj, "balance", "fencing_token") == (1, 12)
        execute("UPDATE testapp_account SET fencing_token = 13 WHERE id = %s", [obj.pk])
        execute("UPDATE testapp_account SET balance = 2 WHERE id = %s", [obj.pk])
        assert stored(obj, "balance", "fencing_token") == (2, 13)

    def test_a_token_given_as_text_is_compared_as_a_number(self) -> None:
        obj = account(12)
        with pytest.raises(StaleFencingToken):
            execute("UPDATE testapp_account SET fencing_token = '3' WHERE id = %s", [obj.pk])
        execute("UPDATE testapp_account SET fencing_token = '13' WHERE id = %s", [obj.pk])
        assert stored(obj, "fencing_token") == (13,)

    @pytest.mark.parametrize("value", ["'abc'", "12.5", "x'00'"])
    def test_a_token_that_is_not_an_integer_is_refused(self, value: str) -> None:
        """SQLite would store it as it is, and text sorts above any integer: every
        later fenced write would be refused."""
        obj = account(12)
        with pytest.raises(IntegrityError, match="must be an integer"):
            execute(f"UPDATE testapp_account SET fencing_token = {value} WHERE id = %s", [obj.pk])
        assert stored(obj, "fencing_token") == (12,)

    def test_null_is_refused(self) -> None:
        obj = account(12)
        with pytest.raises(IntegrityError, match="NOT NULL"):
            execute("UPDATE testapp_account SET fencing_token = NULL WHERE id = %s", [obj.pk])
        assert stored(obj, "fencing_token") == (12,)

    def test_an_unfenced_bulk_update_cannot_lower_either(self) -> None:
        obj = account(50)
        with unfenced(), pytest.raises(StaleFencingToken):
            Account.objects.using(DB).update(fencing_token=1)
        assert stored(obj, "fencing_token") == (50,)

    def test_an_upsert_that_would_lower_the_token_is_refused(self) -> None:
        obj = account(12)
        with pytest.raises(StaleFencingToken):
            execute(
                "INSERT INTO testapp_account (id, owner, balance, updated_at, fencing_token)"
                " VALUES (%s, 'x', 0, '2026-01-01', 3)"
                " ON CONFLICT (id) DO UPDATE SET fencing_token = excluded.fencing_token",
                [obj.pk],
            )
        assert stored(obj, "fencing_token") == (12,)


class TestTheSavePath:
    def test_fenced_saves_work_and_a_stale_one_is_refused(self) -> None:
        obj = account(12)
        obj.balance = 1
        obj.save(using=DB, fencing_token=12)  # the same holder writes again
        obj.balance = 2
        obj.save(using=DB, fencing_token=13)
        obj.balance = 3
        with pytest.raises(StaleFencingToken) as excinfo:
            obj.save(using=DB, fencing_token=5)
        assert (excinfo.value.offered, excinfo.value.stored) == (5, 13)
        assert stored(obj, "balance", "fencing_token") == (2, 13)

    def test_fenced_update(self) -> None:
        low, high = account(5), account(20)
        result = (
            Account.objects.using(DB).filter(pk__in=[low.pk, high.pk]).fenced_update(10, balance=7)
        )
        assert (result.updated, result.stale) == (1, 1)
        assert stored(low, "balance", "fencing_token") == (7, 10)
        assert stored(high, "balance", "fencing_token") == (100, 20)

    def test_a_stale_unfenced_instance_is_refused_by_the_trigger(self) -> None:
        """unfenced() saves are plain Django saves: the instance's own (old) token is
        written, and only the trigger stands between it and the newer row."""
        obj = account(12)
        old = Account.objects.using(DB).get(pk=obj.pk)
        execute("UPDATE testapp_account SET fencing_token = 20 WHERE id = %s", [obj.pk])
        old.balance = 0
        with unfenced(), pytest.raises(StaleFencingToken):
            old.save(using=DB)
        assert stored(obj, "balance", "fencing_token") == (100, 20)


class TestInstallation:
    def test_the_operation_reverses_and_reinstalls_idempotently(self) -> None:
        operation = InstallFencingTrigger("counter")
        state = ProjectState.from_apps(__import__("django.apps").apps.apps)
        connection = connections[DB]
        with connection.schema_editor() as editor:
            operation.database_backwards("testapp", editor, state, state)
        assert "testapp_counter" not in triggers()
        assert "testapp_counter" not in insert_triggers()
        row = Counter.objects.using(DB).create(value=1, fencing_token=12)
        # Without the trigger the database itself takes a lower token (the control).
        execute("UPDATE testapp_counter SET fencing_token = 3 WHERE id = %s", [row.pk])
        assert stored(row, "fencing_token") == (3,)
        with connection.schema_editor() as editor:
            operation.database_forwards("testapp", editor, state, state)
            operation.database_forwards("testapp", editor, state, state)
        assert triggers()["testapp_counter"] == "distlocks_fencing_testapp_counter"
        assert insert_triggers()["testapp_counter"] == "distlocks_fencing_insert_testapp_counter"
        with pytest.raises(StaleFencingToken):
            execute("UPDATE testapp_counter SET fencing_token = 2 WHERE id = %s", [row.pk])

    def test_migrate_again_changes_nothing(self) -> None:
        before = triggers()
        call_command("migrate", database=DB, verbosity=0)
        call_command("migrate", database=DB, verbosity=0)
        assert triggers() == before

    def test_migrating_a_table_away_and_back(self) -> None:
        call_command("migrate", "testapp", "0002", database=DB, verbosity=0)
        assert "testapp parcels" not in triggers()
        call_command("migrate", "testapp", database=DB, verbosity=0)
        assert "testapp parcels" in triggers()

    def test_a_model_of_an_app_migration_with_its_own_table_and_columns(self) -> None:
        """InstallFencingTrigger in an app's migration, on a historical model whose
        table and columns need quoting (a quote in the table name, too)."""
        state = ProjectState()
        state.add_model(
            ModelState(
                "testapp",
                "Ledger",
                [
                    ("id", models.BigAutoField(primary_key=True, db_column="ledger id")),
                    ("note", models.CharField(max_length=20, db_column="Note Text")),
                    ("fencing_token", models.BigIntegerField(default=0)),
                ],
                options={"db_table": "o'brien ledger"},
            )
        )
        model = state.apps.get_model("testapp", "Ledger")
        operation = InstallFencingTrigger("Ledger")
        connection = connections[DB]
        with connection.schema_editor() as editor:
            editor.create_model(model)
            operation.database_forwards("testapp", editor, ProjectState(), state)
        try:
            execute(
                """INSERT INTO "o'brien ledger" ("Note Text", fencing_token) VALUES ('a', 12)"""
            )
            with pytest.raises(StaleFencingToken) as excinfo:
                execute("""UPDATE "o'brien ledger" SET fencing_token = 3, "Note Text" = 'b'""")
            assert excinfo.value.model == "o'brien ledger"
            execute("""UPDATE "o'brien ledger" SET fencing_token = 12, "Note Text" = 'c'""")
            with connection.schema_editor() as editor:
                operation.database_backwards("testapp", editor, state, ProjectState())
            assert "o'brien ledger" not in triggers()
            execute("""UPDATE "o'brien ledger" SET fencing_token = 3""")
        finally:
            with connection.schema_editor() as editor:
                editor.delete_model(model)


# -- the lost-update workload, several processes on one SQLite file -----------------


@pytest.mark.slow
@pytest.mark.parametrize("raw", [False, True], ids=["save", "raw-sql"])
def test_a_paused_holder_loses_no_update(name: str, tmp_path: Path, raw: bool) -> None:
    """Three processes increment a row 8 times each under the lock while a holder
    paused past its TTL waits to write its stale value: through save() (the save
    path refuses it) or through raw SQL (only the trigger can)."""
    result = fencing_workers.run_workload(Counter, name, tmp_path, DB, raw=raw)
    assert str(result["victim"]).startswith("stale"), result
    assert result["final"] == result["successes"] == 24, result
