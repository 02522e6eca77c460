"""A password in a LOCATION never shows (issue "Hardening", defect 1): not in the system
checks, the exception from lock() and its causes, the live-locks page seen by staff
with only the view permission, ``manage.py distlocks list|inspect``, or the log."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings

from distlocks import lock
from distlocks.checks import check_settings
from distlocks.exceptions import LockError
from distlocks.handler import backends
from tests.test_livelocks_admin import _staff

SECRET = "s3cretpw"
REDIS = "distlocks.backends.redis.RedisBackend"

#: Malformed (or unreachable) locations that carry the password, as the issue found them.
BAD = {
    "scheme typo": {"BACKEND": REDIS, "LOCATION": f"reddis://:{SECRET}@127.0.0.1:6379/0"},
    "cluster with a db": {
        "BACKEND": REDIS,
        "LOCATION": f"redis+cluster://:{SECRET}@127.0.0.1:7000/3",
    },
    "sentinel without service": {
        "BACKEND": REDIS,
        "LOCATION": f"redis+sentinel://:{SECRET}@127.0.0.1:26379",
    },
    "one bad redlock entry": {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "LOCATION": ["redis://127.0.0.1:1/0", f"reddis://user:{SECRET}@127.0.0.1:2/0"],
    },
    "unreachable server": {"BACKEND": REDIS, "LOCATION": f"redis://:{SECRET}@127.0.0.1:1/0"},
}


@pytest.fixture(params=list(BAD), ids=list(BAD))
def bad(request: pytest.FixtureRequest, settings: Any) -> str:
    """The alias "bad", configured with one of BAD, beside the test suite's backends."""
    settings.DISTLOCKS_BACKENDS = {**settings.DISTLOCKS_BACKENDS, "bad": BAD[request.param]}
    backends.reset()
    return "bad"


def texts_of(exc: BaseException | None) -> str:
    """An exception, its message, and those of its whole cause/context chain."""
    seen: list[str] = []
    while exc is not None and len(seen) < 20:
        seen += [repr(exc), str(exc)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(seen)


def test_check_messages(bad: str) -> None:
    messages = check_settings()
    text = "\n".join(f"{m.msg} {m.hint}" for m in messages)
    assert SECRET not in text
    if bad != "unreachable server" and "redlock" not in str(BAD):
        assert messages


def test_a_missing_default_alias_shows_the_settings_without_the_password(settings: Any) -> None:
    settings.DISTLOCKS_BACKENDS = {"o": {"LOCATION": f"redis://:{SECRET}@h/0", "BACKEND": REDIS}}
    messages = check_settings()
    assert [m.id for m in messages][:1] == ["distlocks.E001"]
    assert SECRET not in "\n".join(f"{m.msg} {m.hint}" for m in messages)


def test_the_exception_from_lock(bad: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Exception) as excinfo:
        with lock("redaction", backend=bad, timeout=0):
            pass
    assert isinstance(excinfo.value, LockError | Exception)
    assert SECRET not in texts_of(excinfo.value)
    assert SECRET not in caplog.text


@pytest.mark.django_db
def test_the_live_locks_page_for_view_only_staff(
    bad: str, django_user_model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client = Client()
    client.force_login(_staff(django_user_model, "viewer", "view_livelock"))
    page = client.get("/admin/distlocks/livelock/", {"refresh": "0"})
    assert page.status_code == 200
    body = page.content.decode()
    assert "bad" in body  # the backend's error is shown...
    assert SECRET not in body  # ...without the password
    detail = client.get("/admin/distlocks/livelock/lock/", {"backend": bad, "name": "x"})
    assert SECRET not in detail.content.decode()
    assert SECRET not in caplog.text


def test_the_command(bad: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for args in (
        ["list"],
        ["list", "--json"],
        ["inspect", "x"],
        ["inspect", "x", "--backend", bad],
    ):
        out, err = io.StringIO(), io.StringIO()
        failure: BaseException | None = None
        try:
            call_command("distlocks", *args, stdout=out, stderr=err)
        except (CommandError, SystemExit) as exc:
            failure = exc
        assert SECRET not in texts_of(failure)
        assert SECRET not in out.getvalue() + err.getvalue(), args
    assert SECRET not in caplog.text


@override_settings(DEBUG=False)
def test_a_password_in_databases_is_redacted_too(settings: Any) -> None:
    from distlocks.redaction import redact

    password = settings.DATABASES["default"].get("PASSWORD") or ""
    if len(password) < 4:
        pytest.skip("the test database has no password to look for")
    assert password not in redact(f"connection to x failed for {password}")
