"""tests/fast_flush.py leaves the database a transactional test ends with as Django's
flush would: every table empty but the content types and permissions, which hold what
post_migrate writes, and every fencing trigger in place, whatever the test changed."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection, connections
from django.test import TransactionTestCase

from distlocks.fencing import TRIGGER_NAME
from tests import fast_flush
from tests.testapp.models import Counter, PlainCounter

DATABASES = ["default", "sqlite"]


class _Case(TransactionTestCase):
    databases = set(DATABASES)

    def runTest(self) -> None: ...


def _end_of_test() -> None:
    """What pytest-django runs after a transactional test."""
    _Case()._fixture_teardown()


def _contents(alias: str) -> dict[str, Any]:
    """Everything a flush decides, ids aside: the rows of every table, the content
    types and permissions by name, the fencing triggers."""
    conn = connections[alias]
    tables = conn.introspection.django_table_names(only_existing=True, include_views=False)
    with conn.cursor() as cursor:
        counts = {}
        for table in sorted(set(tables) - fast_flush.REFERENCE_TABLES):
            cursor.execute(f"SELECT count(*) FROM {conn.ops.quote_name(table)}")
            counts[table] = cursor.fetchone()[0]
        if conn.vendor == "postgresql":
            cursor.execute(
                "SELECT tgrelid::regclass::text FROM pg_trigger WHERE tgname = %s ORDER BY 1",
                [TRIGGER_NAME],
            )
        else:
            cursor.execute("SELECT tbl_name FROM sqlite_master WHERE type = 'trigger' ORDER BY 1")
        triggers = sorted({row[0] for row in cursor.fetchall()})
    types = sorted(ContentType.objects.using(alias).values_list("app_label", "model"))
    perms = sorted(
        Permission.objects.using(alias).values_list(
            "content_type__app_label", "content_type__model", "codename", "name"
        )
    )
    return {"counts": counts, "types": types, "perms": perms, "triggers": triggers}


def _flushed(alias: str) -> dict[str, Any]:
    call_command("flush", verbosity=0, interactive=False, database=alias, reset_sequences=False)
    return _contents(alias)


def _drop_trigger(alias: str) -> None:
    table = Counter._meta.db_table
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "postgresql":
            cursor.execute(f'DROP TRIGGER {TRIGGER_NAME} ON "{table}"')
        else:
            cursor.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s",
                [table],
            )
            for (name,) in cursor.fetchall():
                cursor.execute(f'DROP TRIGGER "{name}"')


@pytest.mark.django_db(databases=DATABASES, transaction=True)
@pytest.mark.parametrize("alias", DATABASES)
@pytest.mark.parametrize(
    "change",
    ["rows", "drop a trigger", "delete a permission", "rename a content type", "add one"],
)
def test_the_end_of_a_test_leaves_what_a_flush_leaves(alias: str, change: str) -> None:
    expected = _flushed(alias)
    assert expected["types"] and expected["perms"] and expected["triggers"]
    _end_of_test()  # the state a flush left is known from here on
    ids = sorted(ContentType.objects.using(alias).values_list("id", flat=True))
    User.objects.db_manager(alias).create_user("someone")
    Counter.objects.using(alias).create(value=1)
    PlainCounter.objects.using(alias).create(value=1)
    if change == "drop a trigger":
        _drop_trigger(alias)
    elif change == "delete a permission":
        Permission.objects.using(alias).filter(codename="view_counter").delete()
    elif change == "rename a content type":
        ContentType.objects.using(alias).filter(model="counter").update(model="renamed")
    elif change == "add one":
        ContentType.objects.using(alias).create(app_label="gone", model="model")
    assert _contents(alias) != expected
    _end_of_test()
    assert _contents(alias) == expected
    if change == "rows":  # the DELETE path: nothing else was written again
        assert sorted(ContentType.objects.using(alias).values_list("id", flat=True)) == ids
    ContentType.objects.clear_cache()


def test_a_receiver_it_does_not_know_means_a_real_flush() -> None:
    from django.db.models.signals import post_migrate

    def restock(**kwargs: Any) -> None: ...

    assert fast_flush._receivers_known()
    post_migrate.connect(restock)
    try:
        assert not fast_flush._receivers_known()
    finally:
        post_migrate.disconnect(restock)
    assert connection.vendor == "postgresql"
