"""Mistakes made while adopting FencedModel are reported by system checks: a fenced model
under a plain ModelAdmin (distlocks.W003), a fenced table without its trigger
(distlocks.W004, a database check: ``manage.py check --database ALIAS``)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.core import checks
from django.core.management import call_command
from django.db import connections

from distlocks.admin import FencedModelAdmin
from distlocks.apps import install_fencing_triggers
from distlocks.checks import check_fenced_admins, check_fencing_triggers, missing_triggers
from distlocks.fencing import drop_statements
from tests.testapp.models import Account


@pytest.fixture
def site() -> Any:
    site = admin.AdminSite(name="adopting")
    yield site
    # AdminSite instances stay in a WeakSet: forget this one's registrations.
    site._registry.clear()


def test_a_plain_model_admin_on_a_fenced_model_is_reported(site: admin.AdminSite) -> None:
    site.register(Account)
    found = [m for m in check_fenced_admins() if m.obj is Account]
    assert [m.id for m in found] == ["distlocks.W003"]
    assert "FencedModelAdmin" in (found[0].hint or "")
    assert "'adopting'" in (found[0].hint or "")


def test_a_fenced_model_admin_is_not_reported(site: admin.AdminSite) -> None:
    class AccountAdmin(FencedModelAdmin):
        list_display = ("owner",)

    site.register(Account, AccountAdmin)
    assert [m for m in check_fenced_admins() if m.obj is Account] == []


def test_the_test_project_itself_passes() -> None:
    assert [m.id for m in checks.run_checks(tags=[checks.Tags.admin])
            if m.id.startswith("distlocks")] == []  # fmt: skip


def _drop_and_check(alias: str) -> list[checks.CheckMessage]:
    connection = connections[alias]
    table = Account._meta.db_table
    assert missing_triggers(connection, table) == []
    with connection.cursor() as cursor:
        for statement in drop_statements(connection, table):
            cursor.execute(statement)
    try:
        assert missing_triggers(connection, table) != []
        return [m for m in check_fencing_triggers(databases=[alias]) if m.obj is Account]
    finally:
        install_fencing_triggers(using=alias)
        assert missing_triggers(connection, table) == []
        assert [m for m in check_fencing_triggers(databases=[alias]) if m.obj is Account] == []


@pytest.mark.django_db(transaction=True)
def test_a_missing_trigger_is_reported_on_postgresql() -> None:
    found = _drop_and_check("default")
    assert [m.id for m in found] == ["distlocks.W004"]
    assert "migrate --database default" in (found[0].hint or "")


@pytest.mark.django_db(databases=["sqlite"], transaction=True)
def test_a_missing_trigger_is_reported_on_sqlite() -> None:
    found = _drop_and_check("sqlite")
    assert [m.id for m in found] == ["distlocks.W004"]
    assert "migrate --database sqlite" in (found[0].hint or "")


@pytest.mark.django_db(transaction=True)
def test_check_database_command_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    connection = connections["default"]
    with connection.cursor() as cursor:
        for statement in drop_statements(connection, Account._meta.db_table):
            cursor.execute(statement)
    try:
        call_command("check", "--database", "default")
        err = capsys.readouterr()
        assert "distlocks.W004" in err.out + err.err
    finally:
        install_fencing_triggers(using="default")
    call_command("check", "--database", "default")
    err = capsys.readouterr()
    assert "distlocks.W004" not in err.out + err.err
