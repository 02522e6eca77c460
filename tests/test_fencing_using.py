"""A fenced save with ``using=`` another database behaves as Django's save does: an
object loaded from one database is copied to the other (an INSERT there when the row
is missing), and where the row exists there, the token decides as always. Only a row
missing from the database the object was loaded from means "deleted since loaded"."""

from __future__ import annotations

import pytest

from distlocks.exceptions import FencedRowDeleted, StaleFencingToken
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(databases=["default", "sqlite"], transaction=True)


def _on(db: str, pk: int) -> tuple[str, int, int] | None:
    row = Account.objects.using(db).filter(pk=pk).values_list("owner", "balance", "fencing_token")
    return row.first()


def test_a_loaded_object_saved_to_another_database_is_copied_there() -> None:
    source = Account.objects.create(owner="ann", balance=10, fencing_token=5)
    loaded = Account.objects.get(pk=source.pk)
    loaded.balance = 11
    loaded.save(using="sqlite", fencing_token=7)
    assert _on("sqlite", source.pk) == ("ann", 11, 7)
    assert _on("default", source.pk) == ("ann", 10, 5)  # the source is untouched
    assert loaded._state.db == "sqlite"


def test_the_copy_is_still_fenced_where_the_row_exists() -> None:
    source = Account.objects.create(owner="ann", balance=10, fencing_token=5)
    Account.objects.using("sqlite").create(pk=source.pk, owner="bob", balance=1, fencing_token=9)
    loaded = Account.objects.get(pk=source.pk)
    loaded.balance = 12
    with pytest.raises(StaleFencingToken):
        loaded.save(using="sqlite", fencing_token=8)
    assert _on("sqlite", source.pk) == ("bob", 1, 9)
    loaded.save(using="sqlite", fencing_token=9)
    assert _on("sqlite", source.pk) == ("ann", 12, 9)


def test_a_row_deleted_from_its_own_database_is_still_refused() -> None:
    source = Account.objects.create(owner="ann", balance=10, fencing_token=5)
    loaded = Account.objects.get(pk=source.pk)
    Account.objects.filter(pk=source.pk).fenced_delete(6)
    with pytest.raises(FencedRowDeleted):
        loaded.save(using="default", fencing_token=6)
    with pytest.raises(FencedRowDeleted):
        loaded.save(fencing_token=6)
    assert _on("default", source.pk) is None
