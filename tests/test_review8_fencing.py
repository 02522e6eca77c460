# ruff: noqa: F811
"""Review 8: fenced saves the review-7 attack left, on PostgreSQL, SQLite and MariaDB.

* A loaded object whose primary key was changed in memory, then saved: Django's save
  inserts a copy under the new key (the loaded row is left as it was). The fenced save
  raised ``FencedRowDeleted``, saying the row had been deleted, which it had not.
"""

from __future__ import annotations

import pytest
from django.db import DatabaseError

from distlocks.exceptions import FencedRowDeleted, StaleFencingToken

# The fixture itself, each database in turn (test parameters named after it are not redefinitions).
from tests.test_review7_fencing import using  # noqa: F401
from tests.testapp.models import Account


def _loaded(using: str, token: int, owner: str = "ann") -> Account:
    obj = Account(owner=owner, balance=1)
    obj.save(using=using, fencing_token=token)
    return Account.objects.using(using).get(pk=obj.pk)


def _rows(using: str) -> dict[int, tuple[str, int, int]]:
    rows = Account.objects.using(using).values_list("pk", "owner", "balance", "fencing_token")
    return {pk: (owner, balance, token) for pk, owner, balance, token in rows}


class TestAPrimaryKeyChangedInMemory:
    def test_the_save_inserts_a_copy_under_the_new_key(self, using: str) -> None:
        obj = _loaded(using, 5)
        original = obj.pk
        obj.pk, obj.balance = original + 1000, 2
        obj.save(using=using, fencing_token=7)
        assert _rows(using) == {original: ("ann", 1, 5), original + 1000: ("ann", 2, 7)}
        # The copy is now the object's row: the next save updates it.
        obj.balance = 3
        obj.save(using=using, fencing_token=7)
        assert _rows(using)[original + 1000] == ("ann", 3, 7)

    def test_a_copy_is_inserted_even_if_the_loaded_row_is_gone(self, using: str) -> None:
        obj = _loaded(using, 5)
        original = obj.pk
        Account.objects.using(using).filter(pk=original).fenced_delete(9)
        obj.pk = original + 1000
        obj.save(using=using, fencing_token=7)
        assert _rows(using) == {original + 1000: ("ann", 1, 7)}

    def test_a_key_of_an_existing_row_is_a_fenced_update_of_that_row(self, using: str) -> None:
        obj, other = _loaded(using, 5), _loaded(using, 8, owner="bob")
        obj.pk = other.pk
        with pytest.raises(StaleFencingToken):
            obj.save(using=using, fencing_token=7)
        assert _rows(using)[other.pk] == ("bob", 1, 8)
        obj.save(using=using, fencing_token=9)
        assert _rows(using)[other.pk] == ("ann", 1, 9)

    def test_the_same_key_in_another_spelling_is_not_a_new_key(self, using: str) -> None:
        """``"7"`` for the row 7 that was deleted: the row is gone, not copied."""
        obj = _loaded(using, 5)
        Account.objects.using(using).filter(pk=obj.pk).fenced_delete(9)
        obj.pk = str(obj.pk)
        with pytest.raises(FencedRowDeleted, match="deleted after this object was loaded"):
            obj.save(using=using, fencing_token=7)
        assert _rows(using) == {}

    def test_update_fields_with_a_new_key_is_refused_as_django_refuses_it(self, using: str) -> None:
        obj = _loaded(using, 5)
        obj.pk += 1000
        with pytest.raises(DatabaseError, match="did not affect any rows"):
            obj.save(using=using, fencing_token=7, update_fields=["balance"])
        assert list(_rows(using)) == [obj.pk - 1000]
