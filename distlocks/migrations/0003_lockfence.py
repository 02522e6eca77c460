"""The token ceiling of the PostgreSQL backend (docs/safety.md, "PostgreSQL tokens").

Creates ``distlocks_lockfence`` (the ceiling G, one logged row) and
``distlocks_lockepoch`` (the server lifetime marker M, one row) on every database
(like the registry, which the model state has everywhere). On PostgreSQL only: seeds
G from the registry's highest token plus the reserve, so that an upgrade never issues
a token again, and makes the registry and the marker's table UNLOGGED. The marker is
left missing: the first acquisition writes it. Other vendors' tables are left as they
were. Reversible: the registry is logged again and both tables are dropped.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

REGISTRY = "distlocks_lockregistry"
FENCE = "distlocks_lockfence"
EPOCH = "distlocks_lockepoch"
# The same reserve as the backend's (distlocks.backends.postgres.sql.RESERVE_US), kept
# here as a literal: a migration must not change with later code.
RESERVE_US = 600_000_000


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    # Every token the registry shows was issued, and is now under the ceiling.
    schema_editor.execute(
        f"INSERT INTO {quote(FENCE)} (id, ceiling)"
        f" SELECT 1, coalesce(max(fencing_token), 0) + {RESERVE_US} FROM {quote(REGISTRY)}"
        f" ON CONFLICT (id) DO UPDATE SET ceiling = greatest({quote(FENCE)}.ceiling,"
        " EXCLUDED.ceiling)"
    )
    # The ceiling must be on disk before any token relies on it: the migration's
    # transaction commits durably whatever the server's default.
    schema_editor.execute("SET LOCAL synchronous_commit = on")
    schema_editor.execute(f"ALTER TABLE {quote(REGISTRY)} SET UNLOGGED")
    schema_editor.execute(f"ALTER TABLE {quote(EPOCH)} SET UNLOGGED")


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
                ("id", models.PositiveSmallIntegerField(primary_key=True, serialize=False)),
                ("ceiling", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "lock fence",
                "verbose_name_plural": "lock fences",
                "db_table": "distlocks_lockfence",
            },
        ),
        migrations.CreateModel(
            name="LockEpoch",
            fields=[
                ("id", models.PositiveSmallIntegerField(primary_key=True, serialize=False)),
                ("floor", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "lock epoch",
                "verbose_name_plural": "lock epochs",
                "db_table": "distlocks_lockepoch",
            },
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
