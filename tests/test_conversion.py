"""The worked example of docs/adopting.md, run for real: a plain model with rows in the
database becomes a FencedModel through an ordinary migration (AddField, then the
trigger), its old rows get token 0, and a token can no longer go down."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection, migrations, models, transaction
from django.db.migrations.state import ProjectState

from distlocks.exceptions import StaleFencingToken
from distlocks.operations import InstallFencingTrigger

pytestmark = pytest.mark.django_db(transaction=True)

APP = "inventory_example"
BEFORE = [
    migrations.CreateModel(
        "Stock",
        fields=[
            ("id", models.BigAutoField(primary_key=True)),
            ("sku", models.CharField(max_length=20, unique=True)),
            ("count", models.IntegerField(default=0)),
        ],
    )
]
CONVERSION = [
    migrations.AddField(
        model_name="stock",
        name="fencing_token",
        field=models.BigIntegerField(default=0, editable=False),
    ),
    InstallFencingTrigger("stock"),
]


def apply(state: ProjectState, operations: list[migrations.operations.base.Operation]) -> None:
    """Run ``operations`` forwards as ``migrate`` would, updating ``state``."""
    with connection.schema_editor() as editor:
        for operation in operations:
            new = state.clone()
            operation.state_forwards(APP, new)
            operation.database_forwards(APP, editor, state, new)
            state.__dict__.update(new.__dict__)


@pytest.fixture
def state() -> Iterator[ProjectState]:
    state = ProjectState()
    apply(state, BEFORE)
    yield state
    with connection.schema_editor() as editor:
        editor.execute(f"DROP TABLE IF EXISTS {APP}_stock")


def test_a_plain_model_with_rows_becomes_fenced(state: ProjectState) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {APP}_stock (sku, count) VALUES ('A1', 5), ('B2', 7)")
    apply(state, CONVERSION)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT sku, count, fencing_token FROM {APP}_stock ORDER BY sku")
        assert cursor.fetchall() == [("A1", 5, 0), ("B2", 7, 0)]  # old rows: token 0
        # A holder writes with its token; a lower one is refused inside the database.
        cursor.execute(f"UPDATE {APP}_stock SET count = 4, fencing_token = 12 WHERE sku = 'A1'")
    with pytest.raises(StaleFencingToken), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {APP}_stock SET fencing_token = 3 WHERE sku = 'A1'")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count, fencing_token FROM {APP}_stock WHERE sku = 'A1'")
        assert cursor.fetchone() == (4, 12)
