"""A ``list_editable`` save refused by the locks says which row stopped it.

An operator who edited several rows of a FencedModelAdmin list and read "one of these
rows is locked by another holder" had to guess which one, and the page reloads with the
stored values, so the edits to find it again are gone. The message now names the row
(as the admin shows it, escaped as the live-locks pages escape a holder's text)."""

from __future__ import annotations

import pytest
from django.test import Client

from distlocks import lock
from tests.test_admin_fenced import _post_list, make_account
from tests.testapp.models import Account

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


def _named(owner: str, token: int = 0) -> Account:
    row = make_account(token)
    row.owner = owner
    row.save(fencing_token=token)
    return row


def test_a_locked_row_is_named(admin_client: Client) -> None:
    free, busy = _named("free-row"), _named("busy\u202erow")
    with lock(busy.get_fencing_lock_name()):
        response = _post_list(admin_client, {free: 11, busy: 22})
    page = response.content.decode()
    assert "locked by another holder" in page
    messages = page.split('class="messagelist"', 1)[1].split("</ul>", 1)[0]
    # Named, with the bidi control shown escaped (the list below shows the row as Django
    # does: that is Django's own page).
    assert str(Account.objects.get(pk=busy.pk)).replace("\u202e", "\\u202e") in messages
    assert "\u202e" not in messages
    assert "free-row" not in messages
    assert [row.balance for row in Account.objects.order_by("pk")] == [10, 10]


def test_a_stale_row_is_named(admin_client: Client) -> None:
    fresh, stale = _named("fresh-row"), _named("ahead-row", token=2**53 - 1)
    response = _post_list(admin_client, {fresh: 11, stale: 22})
    page = response.content.decode()
    assert "newer lock holder" in page
    messages = page.split('class="messagelist"', 1)[1].split("</ul>", 1)[0]
    assert str(Account.objects.get(pk=stale.pk)) in messages
    assert "fresh-row" not in messages
    assert [row.balance for row in Account.objects.order_by("pk")] == [10, 10]
