"""The token ceilings of the PostgreSQL backend (docs/safety.md, "PostgreSQL tokens").

Creates ``distlocks_lockfence`` on every database (like the registry, which the model
state has everywhere), and on PostgreSQL only: seeds each key's ceiling from the
registry's current token, so that an upgrade never issues a token again, then makes
the registry UNLOGGED. Other vendors' tables are left as they were. Reversible: the
registry is logged again and the ceilings are dropped.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

REGISTRY = "distlocks_lockregistry"
FENCE = "distlocks_lockfence"
# The same reserve as the backend's (distlocks.backends.postgres.sql.RESERVE_US), kept
# here as a literal: a migration must not change with later code.
RESERVE_US = 600_000_000


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    # Every token the registry shows was issued, and is now under its key's ceiling.
    schema_editor.execute(
        f"INSERT INTO {quote(FENCE)} (key, ceiling)"
        f" SELECT key, fencing_token + {RESERVE_US} FROM {quote(REGISTRY)}"
        " WHERE fencing_token > 0"
        f" ON CONFLICT (key) DO UPDATE SET ceiling = greatest({quote(FENCE)}.ceiling,"
        " EXCLUDED.ceiling)"
    )
    # The ceilings must be on disk before any token relies on them: the migration's
    # transaction commits durably whatever the server's default.
    schema_editor.execute("SET LOCAL synchronous_commit = on")
    schema_editor.execute(f"ALTER TABLE {quote(REGISTRY)} SET UNLOGGED")


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(REGISTRY)} SET LOGGED")


class Migration(migrations.Migration):
    dependencies = [
        ("distlocks", "0002_livelock"),
    ]

    operations = [
        migrations.CreateModel(
            name="LockFence",
            fields=[
                ("key", models.BigIntegerField(primary_key=True, serialize=False)),
                ("ceiling", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "lock fence",
                "verbose_name_plural": "lock fences",
                "db_table": "distlocks_lockfence",
            },
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
