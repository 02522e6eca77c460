"""Review 8: what the review-7 attack on fenced rows and the admin left.

* Editing, from ``FencedModelAdmin``, a field that is part of the model's
  ``fencing_lock_name`` answered with a server error (``FencingTokenRequired``): the
  save looked for the lease under the new name, while the admin held the row's lock
  under the name the row was loaded with. Change form and ``list_editable`` alike.
"""

from __future__ import annotations

import pytest
from django.test import Client

from distlocks import get_backend, lock
from tests.testapp.models import Account

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]

#: A lock name built from an editable field (the balance is on the change form and
#: in the list's editable columns).
RENAMING = "account:{pk}:{balance}"


@pytest.fixture
def renaming(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Account, "fencing_lock_name", RENAMING)


def _account(balance: int = 10) -> Account:
    obj = Account(owner="ann", balance=balance)
    obj.save(fencing_token=1)
    return obj


@pytest.mark.usefixtures("renaming")
def test_the_change_form_saves_a_renamed_row_with_the_lease_it_holds(
    admin_client: Client,
) -> None:
    obj = _account()
    old_name = obj.get_fencing_lock_name()
    response = admin_client.post(
        f"/admin/testapp/account/{obj.pk}/change/", {"owner": "ann", "balance": 99}, follow=True
    )
    assert response.status_code == 200
    row = Account.objects.get(pk=obj.pk)
    assert row.balance == 99
    # Saved with the token of the lock the admin took, under the name as loaded.
    assert row.fencing_token == get_backend().fencing_counter(old_name)
    assert get_backend().inspect(old_name) is None  # released


@pytest.mark.usefixtures("renaming")
def test_list_editable_saves_renamed_rows_with_the_leases_it_holds(admin_client: Client) -> None:
    first, second = _account(10), _account(20)
    names = [first.get_fencing_lock_name(), second.get_fencing_lock_name()]
    data = {
        "form-TOTAL_FORMS": "2",
        "form-INITIAL_FORMS": "2",
        "form-MIN_NUM_FORMS": "0",
        "form-MAX_NUM_FORMS": "1000",
        "_save": "Save",
        "form-0-id": str(first.pk),
        "form-0-balance": "11",
        "form-1-id": str(second.pk),
        "form-1-balance": "22",
    }
    response = admin_client.post("/admin/testapp/account/", data, follow=True)
    assert response.status_code == 200
    rows = {row.pk: row for row in Account.objects.all()}
    assert (rows[first.pk].balance, rows[second.pk].balance) == (11, 22)
    backend = get_backend()
    assert rows[first.pk].fencing_token == backend.fencing_counter(names[0])
    assert rows[second.pk].fencing_token == backend.fencing_counter(names[1])


@pytest.mark.usefixtures("renaming")
def test_a_renamed_row_is_still_refused_while_a_worker_holds_its_lock(
    admin_client: Client,
) -> None:
    obj = _account()
    with lock(obj.get_fencing_lock_name()):
        response = admin_client.post(
            f"/admin/testapp/account/{obj.pk}/change/",
            {"owner": "ann", "balance": 99},
            follow=True,
        )
    assert "locked by another holder" in response.content.decode()
    assert Account.objects.values_list("balance", "fencing_token").get() == (10, 1)
