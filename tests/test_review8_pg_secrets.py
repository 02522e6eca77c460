"""Review 8 of the PostgreSQL backend: the DATABASES password of a backend that
*works* (the session's real server, which does not ask for it) is never shown while
a lock is held: not by the lease's, the backend's or the held connection's repr, the
listing, the live-locks pages, ``manage.py distlocks list|inspect``, the errors of a
busy lock, of a force release naming the wrong token, of an exhausted pool and of a
database that does not exist, nor any log record at DEBUG. (tests/test_secret_search.py
searches servers that cannot be reached; this searches the paths that run on one.)
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from distlocks import get_backend, lock
from distlocks.backends.postgres import PostgresBackend
from tests.test_livelocks_admin import _staff
from tests.test_secret_search import PG, configured, surfaces, texts_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("pg_ready")]


@pytest.fixture
def viewer(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(_staff(django_user_model, "viewer8", "view_livelock"))
    return client


def reachable(password: str, name: str | None = None) -> dict[str, Any]:
    own = connection.settings_dict
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name or own["NAME"],
        "USER": own["USER"],
        "PASSWORD": password,
        "HOST": own["HOST"],
        "PORT": own["PORT"],
        "OPTIONS": {"connect_timeout": 5},
    }


def errors_of(*calls: Any) -> list[str]:
    shown = []
    for call in calls:
        try:
            call()
        except Exception as exc:
            shown.append(texts_of(exc))
    return shown


def test_no_surface_of_a_working_backend_shows_the_database_password(
    viewer: Client, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "pw-" + secrets.token_hex(8)
    config = {
        "BACKEND": PG,
        "DATABASE": "secretdb",
        "OPTIONS": {"pool_size": 2, "pool_timeout": 0.2},
    }
    with configured(config, reachable(secret)), caplog.at_level(logging.DEBUG):
        backend = get_backend("bad")
        assert isinstance(backend, PostgresBackend)
        lease = lock("secret-search", backend="bad", ttl=30, timeout=0).acquire()
        try:
            held = backend._held[lease.owner]
            info = backend.inspect("secret-search")
            shown = [
                repr(lease),
                str(lease),
                repr(backend),
                repr(held),
                repr(held.conn),
                repr(info),
                repr(list(backend.iter_locks())),
                *errors_of(
                    lambda: lock("secret-search", backend="bad", timeout=0).acquire(),
                    lambda: backend.force_release("secret-search", token=lease.fencing_token + 1),
                ),
            ]
            with lock("secret-other", backend="bad", ttl=30, timeout=0):  # the pool's last
                shown += errors_of(lambda: lock("secret-third", backend="bad", timeout=0).acquire())
                assert "pool_size" in shown[-1]
            for surface, text in surfaces(viewer):
                shown.append(f"{surface}: {text}")
            page = viewer.get(
                "/admin/distlocks/livelock/lock/", {"backend": "bad", "name": "secret-search"}
            )
            shown.append(page.content.decode())
        finally:
            lease.release()
        shown.append(caplog.text)
    for text in shown:
        assert secret not in text, text[:2000]


def test_a_database_that_does_not_exist_is_refused_without_the_password(
    viewer: Client, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "pw-" + secrets.token_hex(8)
    config = {"BACKEND": PG, "DATABASE": "secretdb"}
    missing = "no_such_db_" + secrets.token_hex(4)
    with configured(config, reachable(secret, missing)), caplog.at_level(logging.DEBUG):
        shown = errors_of(lambda: lock("secret-search", backend="bad", timeout=0).acquire())
        shown += [f"{surface}: {text}" for surface, text in surfaces(viewer)]
        shown.append(caplog.text)
    assert any(missing in text for text in shown)  # the error says which database
    for text in shown:
        assert secret not in text, text[:2000]
