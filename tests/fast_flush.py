"""A quicker end for transactional tests (``django_db(transaction=True)``), with the
same database left behind.

Django empties the database after each such test with ``flush``: a TRUNCATE of every
table, then the post_migrate signal, which writes the content types and permissions
back and reinstalls the fencing triggers. On PostgreSQL that is 0.1-0.2 s a test (a
TRUNCATE makes new files for every table; the permissions are dozens of queries), for
400-odd tests of this suite.

Here a test's tables are emptied with DELETE instead, and the content types,
permissions, triggers and trigger functions are kept, but only when they are exactly
as the last real ``flush`` left them (compared row by row, one query each): then a
``flush`` would write back the very same rows (under new ids). Anything else (a test
that dropped a trigger, added a content type, a database other than PostgreSQL or
SQLite, a signal receiver this module does not know, ``available_apps``, serialized
rollback, a DELETE that fails) falls back to Django's own ``flush``, after which the
state is read again.
"""

from __future__ import annotations

import weakref
from typing import Any

from django.core.management import call_command
from django.db import DatabaseError, connections, transaction
from django.db.models.signals import post_migrate
from django.test import TransactionTestCase

#: Tables a ``flush`` empties and post_migrate fills again: kept when unchanged.
REFERENCE_TABLES = frozenset({"django_content_type", "auth_permission"})

#: What post_migrate may do for this shortcut to hold: write content types and
#: permissions, install fencing triggers. Another receiver means a real flush.
KNOWN_RECEIVERS = frozenset(
    {
        "django.contrib.auth.management.create_permissions",
        "django.contrib.contenttypes.management.create_contenttypes",
        "distlocks.apps.install_fencing_triggers",
    }
)

_REFERENCE_QUERIES = {
    "postgresql": [
        "SELECT id, app_label, model FROM django_content_type ORDER BY id",
        "SELECT id, content_type_id, codename, name FROM auth_permission ORDER BY id",
        "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger"
        " WHERE NOT tgisinternal ORDER BY 1, 2",
        "SELECT p.oid::regprocedure::text, md5(p.prosrc) FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1",
    ],
    "sqlite": [
        "SELECT id, app_label, model FROM django_content_type ORDER BY id",
        "SELECT id, content_type_id, codename, name FROM auth_permission ORDER BY id",
        "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY name",
    ],
}

#: Per database alias: the reference state the last real flush left.
_after_flush: dict[str, Any] = {}


def _reference_state(alias: str) -> Any:
    connection = connections[alias]
    with connection.cursor() as cursor:
        state = []
        for query in _REFERENCE_QUERIES[connection.vendor]:
            cursor.execute(query)
            state.append(cursor.fetchall())
    return state


def _receivers_known() -> bool:
    """Every post_migrate receiver is one of KNOWN_RECEIVERS (False where the signal's
    private list of receivers is not shaped as this Django's: a real flush then)."""
    names = set()
    try:
        for entry in post_migrate.receivers:
            receiver = entry[1]
            if isinstance(receiver, weakref.ReferenceType):
                receiver = receiver()
            if receiver is not None:
                names.add(f"{receiver.__module__}.{receiver.__qualname__}")
    except (AttributeError, IndexError, TypeError):
        return False
    return names <= KNOWN_RECEIVERS


def _delete_all(alias: str) -> bool:
    """Empty every table a flush would, except the reference tables, if these are as
    the last flush left them. False where a real flush is needed."""
    connection = connections[alias]
    if connection.vendor not in _REFERENCE_QUERIES or alias not in _after_flush:
        return False
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    if not set(tables) >= REFERENCE_TABLES or not _receivers_known():
        return False
    try:
        if _reference_state(alias) != _after_flush[alias]:
            return False
        quote = connection.ops.quote_name
        # Foreign keys are deferred (Django creates them so): checked at the commit,
        # when every referencing table is empty too.
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            for table in sorted(set(tables) - REFERENCE_TABLES):
                cursor.execute(f"DELETE FROM {quote(table)}")
    except DatabaseError:
        return False
    return True


def _fixture_teardown(self: TransactionTestCase) -> None:
    """TransactionTestCase._fixture_teardown, with DELETE where it leaves the same."""
    for alias in self._databases_names(include_mirrors=False):
        # Django's own choice (TransactionTestCase._fixture_teardown).
        inhibit_post_migrate = self.available_apps is not None or (
            self.serialized_rollback and hasattr(connections[alias], "_test_serialized_contents")
        )
        if not inhibit_post_migrate and _delete_all(alias):
            continue
        call_command(
            "flush",
            verbosity=0,
            interactive=False,
            database=alias,
            reset_sequences=False,
            allow_cascade=self.available_apps is not None,
            inhibit_post_migrate=inhibit_post_migrate,
        )
        if not inhibit_post_migrate and connections[alias].vendor in _REFERENCE_QUERIES:
            _after_flush[alias] = _reference_state(alias)
        else:
            _after_flush.pop(alias, None)


def install() -> None:
    TransactionTestCase._fixture_teardown = _fixture_teardown  # type: ignore[method-assign]
