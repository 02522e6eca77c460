"""Fencing enforced inside MySQL/MariaDB: a BEFORE UPDATE trigger installed by
migrate and by InstallFencingTrigger refuses an UPDATE that lowers a row's token
(SIGNAL SQLSTATE '45000'), and its error is StaleFencingToken on Django's
connections. Against a real MariaDB (Debian's mariadb-server, started by the
``mariadb`` fixture); skipped, saying what to install, where there is none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import IntegrityError, connections, models
from django.db.migrations.state import ModelState, ProjectState

from distlocks import fencing
from distlocks.exceptions import StaleFencingToken
from distlocks.operations import InstallFencingTrigger
from tests import fencing_workers
from tests.conftest import database_alias
from tests.testapp.models import Account, Counter, Parcel

DB = "mariadb"


@pytest.fixture(autouse=True)
def mdb(mariadb: str, django_db_blocker: Any) -> Iterator[str]:
    """Database access for the test (pytest-django blocks it outside its own marks)."""
    with django_db_blocker.unblock():
        yield mariadb


def _all_triggers(alias: str) -> list[tuple[str, str]]:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT EVENT_OBJECT_TABLE, TRIGGER_NAME FROM information_schema.TRIGGERS"
            " WHERE TRIGGER_SCHEMA = DATABASE() AND TRIGGER_NAME LIKE 'distlocks%%'"
            " ORDER BY 1, 2"
        )
        return list(cursor.fetchall())


def triggers(alias: str = DB) -> dict[str, str]:
    """Table -> the name of its distlocks update trigger."""
    return {t: n for t, n in _all_triggers(alias) if not n.startswith("distlocks_fencing_insert")}


def insert_triggers(alias: str = DB) -> dict[str, str]:
    """Table -> the name of its distlocks insert trigger."""
    return {t: n for t, n in _all_triggers(alias) if n.startswith("distlocks_fencing_insert")}


def execute(sql: str, params: list[Any] | None = None, alias: str = DB) -> None:
    with connections[alias].cursor() as cursor:
        cursor.execute(sql, params)


def account(token: int, balance: int = 100) -> Account:
    return Account.objects.using(DB).create(owner="ann", balance=balance, fencing_token=token)


def stored(obj: models.Model, *fields: str) -> tuple[Any, ...]:
    return tuple(type(obj)._base_manager.using(DB).values_list(*fields).get(pk=obj.pk))


@contextlib.contextmanager
def sql_mode(mode: str) -> Iterator[None]:
    execute(f"SET SESSION sql_mode = '{mode}'")
    try:
        yield
    finally:
        connections[DB].close()  # the next connection gets Django's own settings


def test_the_database_is_mariadb() -> None:
    connection = connections[DB]
    assert connection.vendor == "mysql"
    assert getattr(connection, "mysql_is_mariadb", False)


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
        assert (excinfo.value.offered, excinfo.value.stored) == (3, 12)
        assert excinfo.value.model == "testapp_account"
        assert stored(obj, "balance", "fencing_token") == (100, 12)

    def test_raw_sql_cannot_lower_it_on_a_table_and_column_needing_quotes(self) -> None:
        parcel = Parcel(code="P-1")
        parcel.save(using=DB, fencing_token=12)
        with pytest.raises(StaleFencingToken) as excinfo:
            execute(
                "UPDATE `testapp parcels` SET fencing_token = 3, `Parcel Code` = %s"
                " WHERE `parcel id` = %s",
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

    def test_null_is_refused_even_in_a_non_strict_session(self) -> None:
        """Without strict mode MySQL would store 0 for the NULL after the trigger ran."""
        obj = account(12)
        with sql_mode(""), pytest.raises(IntegrityError, match="cannot be null"):
            execute("UPDATE testapp_account SET fencing_token = NULL WHERE id = %s", [obj.pk])
        assert stored(obj, "fencing_token") == (12,)

    def test_text_a_non_strict_session_turns_into_0_is_refused(self) -> None:
        obj = account(12)
        with sql_mode(""), pytest.raises(StaleFencingToken) as excinfo:
            execute("UPDATE testapp_account SET fencing_token = 'abc' WHERE id = %s", [obj.pk])
        assert (excinfo.value.offered, excinfo.value.stored) == (0, 12)
        assert stored(obj, "fencing_token") == (12,)

    def test_an_unfenced_bulk_update_cannot_lower_either(self) -> None:
        obj = account(50)
        with fencing.unfenced(), pytest.raises(StaleFencingToken):
            Account.objects.using(DB).filter(pk=obj.pk).update(fencing_token=1)
        assert stored(obj, "fencing_token") == (50,)

    def test_an_upsert_that_would_lower_the_token_is_refused(self) -> None:
        obj = account(12)
        with pytest.raises(StaleFencingToken):
            execute(
                "INSERT INTO testapp_account (id, owner, balance, updated_at, fencing_token)"
                " VALUES (%s, 'x', 0, '2026-01-01', 3)"
                " ON DUPLICATE KEY UPDATE fencing_token = VALUES(fencing_token)",
                [obj.pk],
            )
        assert stored(obj, "fencing_token") == (12,)


class TestTheSavePath:
    def test_fenced_saves_work_and_a_stale_one_is_refused(self) -> None:
        obj = account(12)
        obj.balance = 1
        obj.save(using=DB, fencing_token=12)
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
        obj = account(12)
        old = Account.objects.using(DB).get(pk=obj.pk)
        execute("UPDATE testapp_account SET fencing_token = 20 WHERE id = %s", [obj.pk])
        old.balance = 0
        with fencing.unfenced(), pytest.raises(StaleFencingToken):
            old.save(using=DB)
        assert stored(obj, "balance", "fencing_token") == (100, 20)


class TestInstallation:
    def test_the_operation_reverses_and_reinstalls_idempotently(self) -> None:
        from django.apps import apps

        operation = InstallFencingTrigger("counter")
        state = ProjectState.from_apps(apps)
        connection = connections[DB]
        try:
            with connection.schema_editor() as editor:
                operation.database_backwards("testapp", editor, state, state)
            assert "testapp_counter" not in triggers()
            assert "testapp_counter" not in insert_triggers()
            row = Counter.objects.using(DB).create(value=1, fencing_token=12)
            # Without the trigger the database itself takes a lower token (the control).
            execute("UPDATE testapp_counter SET fencing_token = 3 WHERE id = %s", [row.pk])
            assert stored(row, "fencing_token") == (3,)
        finally:
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
        assert triggers() == before

    def test_a_long_table_name_needing_quotes(self) -> None:
        """MySQL names triggers per schema in 64 characters: the table's name is
        shortened with a hash in the trigger's."""
        table = "o'brien ledger " + "x" * 49  # 64 characters, MySQL's longest
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
                options={"db_table": table},
            )
        )
        model = state.apps.get_model("testapp", "Ledger")
        operation = InstallFencingTrigger("Ledger")
        connection = connections[DB]
        with connection.schema_editor() as editor:
            editor.create_model(model)
        try:
            with connection.schema_editor() as editor:
                operation.database_forwards("testapp", editor, ProjectState(), state)
            name = triggers()[table]
            assert len(name) <= 64 and name.startswith("distlocks_fencing_o'brien")
            execute(f"INSERT INTO `{table}` (`Note Text`, fencing_token) VALUES ('a', 12)")
            with pytest.raises(StaleFencingToken) as excinfo:
                execute(f"UPDATE `{table}` SET fencing_token = 3, `Note Text` = 'b'")
            assert excinfo.value.model == table[: len(str(excinfo.value.model))]
            with connection.schema_editor() as editor:
                operation.database_backwards("testapp", editor, state, ProjectState())
            assert table not in triggers()
            execute(f"UPDATE `{table}` SET fencing_token = 3")
        finally:
            with connection.schema_editor() as editor:
                editor.delete_model(model)


class TestPrivileges:
    """Creating the trigger needs TRIGGER on the table and, with binary logging on,
    SUPER or log_bin_trust_function_creators = 1; without them, migrate says so."""

    @pytest.fixture
    def binlog_server(self, tmp_path: Path) -> Iterator[Any]:
        from distlocks.testing.servers import MariaDBServer

        server = MariaDBServer(tmp_path / "binlog", log_bin=True).start()
        try:
            server.execute("CREATE USER 'app'@'%' IDENTIFIED BY 'app-secret'")
            server.execute(
                "GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, DROP, ALTER, INDEX"
                " ON distlocks.* TO 'app'@'%'"
            )
            server.execute(
                "CREATE TABLE distlocks.ledger (id INT PRIMARY KEY, fencing_token BIGINT NOT NULL)"
            )
            server.execute("INSERT INTO distlocks.ledger VALUES (1, 12)")
            yield server
        finally:
            server.stop()

    def test_missing_privileges_are_named(self, binlog_server: Any) -> None:
        url = binlog_server.url_for("distlocks", user="app", password="app-secret")
        with database_alias("mariadb_app", url) as alias:
            connection = connections[alias]
            with pytest.raises(ImproperlyConfigured) as excinfo:
                fencing.install_trigger(connection, "ledger")
            assert "log_bin_trust_function_creators" in str(excinfo.value)
            assert "app-secret" not in str(excinfo.value)

            binlog_server.execute("SET GLOBAL log_bin_trust_function_creators = 1")
            connection.close()
            with pytest.raises(ImproperlyConfigured, match="TRIGGER privilege"):
                fencing.install_trigger(connection, "ledger")

            binlog_server.execute("GRANT TRIGGER ON distlocks.* TO 'app'@'%'")
            connection.close()
            fencing.install_trigger(connection, "ledger")
            assert triggers(alias) == {"ledger": "distlocks_fencing_ledger"}
            with pytest.raises(StaleFencingToken):
                execute("UPDATE ledger SET fencing_token = 3", alias=alias)


# -- the lost-update workload, several processes on one MariaDB database -------------


@pytest.mark.slow
@pytest.mark.parametrize("raw", [False, True], ids=["save", "raw-sql"])
def test_a_paused_holder_loses_no_update(name: str, tmp_path: Path, raw: bool) -> None:
    """Three processes increment a row 8 times each under the lock while a holder
    paused past its TTL waits to write its stale value: through save() (the save
    path refuses it) or through raw SQL (only the trigger can)."""
    result = fencing_workers.run_workload(Counter, name, tmp_path, DB, raw=raw)
    assert str(result["victim"]).startswith("stale"), result
    assert result["final"] == result["successes"] == 24, result
