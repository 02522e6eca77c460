"""FencedModelAdmin: admin edits take the row's lock and save with its token."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from distlocks import get_backend, lock
from tests.testapp.models import Account

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


@pytest.fixture
def staff(admin_client: Client) -> Client:
    return admin_client


def _post(client: Client, obj: Account, balance: int) -> object:
    return client.post(
        f"/admin/testapp/account/{obj.pk}/change/",
        {"owner": obj.owner, "balance": balance},
        follow=True,
    )


def make_account(token: int = 0) -> Account:
    obj = Account(owner="ann", balance=10)
    obj.save(fencing_token=token)
    return obj


def test_admin_edit_saves_with_a_fresh_token(staff: Client) -> None:
    obj = make_account()
    response = _post(staff, obj, 99)
    assert response.status_code == 200
    row = Account.objects.get(pk=obj.pk)
    assert row.balance == 99
    assert row.fencing_token > 0
    assert get_backend().inspect(obj.get_fencing_lock_name()) is None  # released


def test_admin_edit_waits_for_the_rows_lock_then_refuses(staff: Client) -> None:
    obj = make_account()
    with lock(obj.get_fencing_lock_name()):
        response = _post(staff, obj, 1)
    assert Account.objects.get(pk=obj.pk).balance == 10
    assert "locked by another holder" in response.content.decode()


def test_admin_add_creates_the_row(staff: Client) -> None:
    response = staff.post(
        "/admin/testapp/account/add/", {"owner": "new", "balance": 5}, follow=True
    )
    assert response.status_code == 200
    assert Account.objects.get(owner="new").fencing_token == 0


def test_admin_holds_the_row_lock_until_its_transaction_commits(staff: Client) -> None:
    """A worker must not get the row's lock while the admin's edit is uncommitted."""
    from django.contrib.admin.models import LogEntry
    from django.db.models.signals import post_save

    from distlocks.exceptions import LockNotAcquired

    obj = make_account()
    seen: list[str] = []

    def try_lock_from_worker(sender: object, **kwargs: object) -> None:
        # Runs inside the admin's transaction, after the save (LogEntry comes last).
        import threading

        def worker() -> None:
            try:
                lock(obj.get_fencing_lock_name(), timeout=0).acquire().release()
                seen.append("worker got the lock")
            except LockNotAcquired:
                seen.append("busy")

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()

    post_save.connect(try_lock_from_worker, sender=LogEntry)
    try:
        _post(staff, obj, 42)
    finally:
        post_save.disconnect(try_lock_from_worker, sender=LogEntry)
    assert seen == ["busy"]
    assert Account.objects.get(pk=obj.pk).balance == 42


def _post_list(client: Client, balances: dict[Account, int]) -> object:
    """A ``list_editable`` save of the changelist, as the admin's form submits it."""
    data = {
        "form-TOTAL_FORMS": str(len(balances)),
        "form-INITIAL_FORMS": str(len(balances)),
        "form-MIN_NUM_FORMS": "0",
        "form-MAX_NUM_FORMS": "1000",
        "_save": "Save",
    }
    for i, (obj, balance) in enumerate(balances.items()):
        data[f"form-{i}-id"] = str(obj.pk)
        data[f"form-{i}-balance"] = str(balance)
    return client.post("/admin/testapp/account/", data, follow=True)


def test_list_editable_saves_each_row_with_its_own_lock(staff: Client) -> None:
    first, second = make_account(), make_account()
    response = _post_list(staff, {first: 11, second: 22})
    assert response.status_code == 200
    rows = {row.pk: row for row in Account.objects.all()}
    assert (rows[first.pk].balance, rows[second.pk].balance) == (11, 22)
    assert rows[first.pk].fencing_token > 0 and rows[second.pk].fencing_token > 0
    for obj in (first, second):
        assert get_backend().inspect(obj.get_fencing_lock_name()) is None  # released


def test_list_editable_with_one_row_locked_saves_nothing(staff: Client) -> None:
    first, second = make_account(), make_account()
    with lock(second.get_fencing_lock_name()):
        response = _post_list(staff, {first: 11, second: 22})
    assert response.status_code == 200
    assert "locked by another holder" in response.content.decode()
    assert [row.balance for row in Account.objects.order_by("pk")] == [10, 10]
    assert get_backend().inspect(first.get_fencing_lock_name()) is None


def test_list_editable_save_refused_when_a_newer_holder_wrote(staff: Client) -> None:
    """The token check still applies to each row: a row whose stored token is ahead
    of the one the admin gets refuses the save, and the whole list save rolls back."""
    first = make_account()
    second = make_account(token=2**53 - 1)  # ahead of any token the lock will give
    response = _post_list(staff, {first: 11, second: 22})
    assert response.status_code == 200
    assert "newer lock holder" in response.content.decode()
    assert [row.balance for row in Account.objects.order_by("pk")] == [10, 10]


def test_list_editable_with_more_rows_than_the_pool_can_lock_says_so(
    staff: Client, settings: Any
) -> None:
    """On a PostgreSQL alias in session mode each row lock pins a pooled connection: a
    list save of more rows than the pool holds can never lock them all. The page says
    so and what to change (no error page, no wait for the timeout), and nothing is
    written."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "default": {
            "BACKEND": "distlocks.backends.postgres.PostgresBackend",
            "DATABASE": "default",
            "OPTIONS": {"pool_size": 2},
        },
    }
    rows = [make_account() for _ in range(3)]
    response = _post_list(staff, {row: 50 + i for i, row in enumerate(rows)})
    assert response.status_code == 200
    page = response.content.decode()
    assert "Not saved" in page and "pool_size" in page, page[-3000:]
    assert [row.balance for row in Account.objects.order_by("pk")] == [10, 10, 10]
    assert all(get_backend().inspect(row.get_fencing_lock_name()) is None for row in rows)
