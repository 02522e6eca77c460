"""Review 7: the admin page of live locks, attacked with hand-made input.

* A force-release form whose token is made of digits Python's ``str.isdigit()``
  accepts but ``int()`` does not ("²", superscript two) answered with a server error
  (500); digits of other scripts ("١٢") were read as a token. Both must be "names no
  valid token": a message, nothing released, no audit entry.
* Markup in a lock's name and in the holder's extras (the Celery task id) is shown
  escaped on the list, the lock's page, the confirmation page and in the messages.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client

from distlocks import get_backend, lock
from distlocks.locks import holder_extra
from tests.test_livelocks_admin import LIST_URL, LOCK_URL, RELEASE_URL, _staff, csrf_post

pytestmark = pytest.mark.django_db

MARKUP = '<img src=x onerror="alert(1)">'


@pytest.fixture
def releaser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(
        _staff(django_user_model, "releaser7", "view_livelock", "force_release_livelock")
    )
    return client


@pytest.mark.parametrize(
    "token",
    ["\u00b2", "\u00b9\u00b2", "\u0661\u0662", "\uff11\uff12", "\u0663" * 19, "\U0001d7d7"],
    ids=repr,
)
def test_a_token_of_other_digits_names_no_holder(releaser: Client, name: str, token: str) -> None:
    lease = lock(name, backend="redis", ttl=30).acquire()
    try:
        response = releaser.post(
            RELEASE_URL, {"backend": "redis", "name": name, "fencing_token": token}, follow=True
        )
        assert response.status_code == 200
        assert "was not released" in response.content.decode()
        assert lease.held()
        info = get_backend("redis").inspect(name)
        assert info is not None and info.owner == lease.owner
        assert not LogEntry.objects.exists()
    finally:
        lease.release()


def test_markup_in_names_and_extras_is_escaped_everywhere(releaser: Client, name: str) -> None:
    evil = f"{name}{MARKUP}"
    reset = holder_extra.set({"celery_task_id": MARKUP})
    try:
        lease = lock(evil, backend="locmem", ttl=30).acquire()
    finally:
        holder_extra.reset(reset)
    try:
        pages = {
            "list": releaser.get(LIST_URL, {"q": name}),
            "lock": releaser.get(LOCK_URL, {"backend": "locmem", "name": evil}),
            "confirm": releaser.get(RELEASE_URL, {"backend": "locmem", "name": evil}),
        }
        for page, response in pages.items():
            assert response.status_code == 200, page
            html = response.content.decode()
            assert MARKUP not in html, page
            assert "&lt;img src=x onerror=" in html, page
        done = csrf_post(
            releaser,
            RELEASE_URL,
            {"backend": "locmem", "name": evil, "fencing_token": lease.fencing_token},
        )
        assert done.status_code == 302
        after = releaser.get(done["Location"]).content.decode()
        assert "was force-released" in after
        assert MARKUP not in after
        history = releaser.get("/admin/").content.decode()
        assert MARKUP not in history
    finally:
        lease.release()
