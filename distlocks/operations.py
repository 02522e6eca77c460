"""Migration operations.

``InstallFencingTrigger`` puts the fencing trigger on an existing table, in the
app's own migrations::

    from distlocks.operations import InstallFencingTrigger

    class Migration(migrations.Migration):
        dependencies = [("billing", "0007_account_fencing_token")]
        operations = [InstallFencingTrigger("account")]

``migrate`` also (re)installs it on every concrete FencedModel table after each
run, so the operation is for making the step explicit and reversible.
"""

from __future__ import annotations

from typing import Any

from django.db.migrations.operations.base import Operation

from distlocks import fencing


class InstallFencingTrigger(Operation):
    """Reject, inside the database, any UPDATE that lowers ``fencing_token`` of a row
    of ``model_name``: a trigger on PostgreSQL, SQLite and MySQL/MariaDB, a no-op on
    other databases. Reversed, it drops the trigger."""

    reversible = True
    reduces_to_sql = True

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (self.__class__.__name__, [self.model_name], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # the model state does not change

    def _run(self, app_label: str, schema_editor: Any, state: Any, install: bool) -> None:
        connection = schema_editor.connection
        model = state.apps.get_model(app_label, self.model_name)
        if not fencing.enforces(connection) or not self.allow_migrate_model(
            connection.alias, model
        ):
            return
        table = model._meta.db_table
        statements = (
            fencing.install_statements(connection, table)
            if install
            else fencing.drop_statements(connection, table)
        )
        fencing.run_statements(
            connection, table, statements, lambda sql: schema_editor.execute(sql, params=None)
        )

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._run(app_label, schema_editor, to_state, install=True)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._run(app_label, schema_editor, from_state, install=False)

    def describe(self) -> str:
        return f"Install the distlocks fencing trigger on {self.model_name}"

    @property
    def migration_name_fragment(self) -> str:
        return f"fencing_trigger_{self.model_name.lower()}"
