"""A password in a LOCATION never shows (issue "Hardening", defect 1): not in the system
checks, the exception from lock() and its causes, the live-locks page seen by staff
with only the view permission, ``manage.py distlocks list|inspect``, or the log."""

from __future__ import annotations

import io
import logging
import re
from typing import Any
from urllib.parse import unquote

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from distlocks import lock
from distlocks.checks import check_settings
from distlocks.exceptions import LockError
from distlocks.handler import backends
from distlocks.redaction import redact
from tests.test_livelocks_admin import _staff
from tests.test_secret_search import secret_locations

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
    # Found by probing every place a parser can quote a piece of the URL:
    "port not a number": {"BACKEND": REDIS, "LOCATION": f"redis://:{SECRET}@127.0.0.1:x/0"},
    "db not a number": {"BACKEND": REDIS, "LOCATION": f"redis://:{SECRET}@127.0.0.1:6379/x"},
    # urllib reads "u:s3cretpw/x@..." as host "u", port "s3cretpw": the port is quoted.
    "unencoded slash in the password": {
        "BACKEND": REDIS,
        "LOCATION": f"redis://u:{SECRET}/x@127.0.0.1:1/0",
    },
    "location not a string": {"BACKEND": REDIS, "LOCATION": {"url": f"redis://:{SECRET}@h/0"}},
    "bad query option": {
        "BACKEND": REDIS,
        "LOCATION": f"rediss://:{SECRET}@127.0.0.1:1/0?ssl_cert_reqs=bogus",
    },
    "password in OPTIONS": {
        "BACKEND": REDIS,
        "LOCATION": "redis://127.0.0.1:1/0",
        "OPTIONS": {"client_kwargs": {"password": SECRET}},
    },
    "password as a query parameter": {
        "BACKEND": REDIS,
        "LOCATION": f"redis://127.0.0.1:1/0?password={SECRET}",
    },
    "unix socket": {"BACKEND": REDIS, "LOCATION": f"unix://:{SECRET}@/nonexistent/sock?db=0"},
    "sentinel service path": {
        "BACKEND": REDIS,
        "LOCATION": f"redis+sentinel://:{SECRET}@127.0.0.1:1/mymaster/0",
    },
    "redlock given a string": {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "LOCATION": f"redis://:{SECRET}@127.0.0.1:1/0",
    },
    "redlock with a bad port and a number": {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "LOCATION": ["redis://127.0.0.1:1/0", f"redis://:{SECRET}@127.0.0.1:x/0", 5],
    },
    "backend path that does not import": {
        "BACKEND": "distlocks.backends.redis.Nope",
        "LOCATION": f"redis://:{SECRET}@h/0",
    },
    "zookeeper": {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        "LOCATION": f"zk://u:{SECRET}@127.0.0.1:1",
        # Nothing listens there: give up in 0.5 s, not the default 3 s, per call.
        "OPTIONS": {"connect_timeout": 0.5},
    },
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


#: Cases whose configuration is fine (the server is simply not there).
WELL_FORMED = {
    "unreachable server",
    "password in OPTIONS",
    "password as a query parameter",
    "unix socket",
    "zookeeper",
    "sentinel service path",
    "bad query option",
}  # fmt: skip (the last is refused by the server's client)


def test_check_messages(bad: str, request: pytest.FixtureRequest) -> None:
    messages = check_settings()
    text = "\n".join(f"{m.msg} {m.hint}" for m in messages)
    assert SECRET not in text
    if request.node.callspec.params["bad"] not in WELL_FORMED:
        assert "'bad'" in text  # the malformed entry is reported


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
        ["release", "x", "--backend", bad, "--yes"],
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
    password = settings.DATABASES["default"].get("PASSWORD") or ""
    if len(password) < 4:
        pytest.skip("the test database has no password to look for")
    assert password not in redact(f"connection to x failed for {password}")


def test_a_password_cut_by_the_url_parser_is_named_nowhere_and_the_fix_is_said() -> None:
    """urllib reads "redis://u:pw/rest@host" as host "u" and port "pw": the error it
    raises quotes the password as a port. The LOCATION is refused when the backend is
    configured, without any piece of the password, saying to percent-encode it."""
    from distlocks.backends.redis import RedisBackend

    location = f"redis://user:{SECRET}/more@127.0.0.1:6379/0"
    problems = RedisBackend.validate_config("x", {"BACKEND": REDIS, "LOCATION": location})
    text = "\n".join(problems)
    assert "percent-encoded" in text
    assert SECRET not in text and "more" not in text.replace("more than", "")


def test_log_records_of_distlocks_loggers_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a module logs (a driver's error quoting a URL in the exception chain,
    or the message itself), the record that reaches a handler names no password."""
    caplog.set_level(logging.DEBUG)
    logger = logging.getLogger("distlocks.renewal")
    try:
        try:
            raise ConnectionError(f"cannot reach redis://:{SECRET}@10.0.0.1:6379/0")
        except ConnectionError as inner:
            raise LockError("renewal failed") from inner
    except LockError:
        logger.exception("lease of %s on redis://:%s@h/0 failed", "name", SECRET)
    assert caplog.records
    assert SECRET not in caplog.text
    assert "renewal failed" in caplog.text and "10.0.0.1" in caplog.text


# -- issue 24, item 5: a LOCATION missing a character of "://", and its whole class ----


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        # One character of "://" missing: the user information is masked whole, the
        # scheme, host and port stay readable.
        ("redis//:pw@127.0.0.1:6379/0", "redis//***@127.0.0.1:6379/0"),
        ("redis:/:pw@127.0.0.1:6379/0", "redis:/***@127.0.0.1:6379/0"),
        ("rediss//:pw@h:6380", "rediss//***@h:6380"),
        ("redis:pw@h", "redis:***@h"),
        ("redis:\\\\:pw@h", "redis:\\\\***@h"),
        ("LOCATION 'redis//user:pw@[::1]:1/0' is bad", "LOCATION 'redis//***@[::1]:1/0' is bad"),
        # No scheme, several "@", percent-encoding: everything before the last "@".
        ("u:p@ss@h:1", "***@h:1"),
        ("%70w@h", "***@h"),
        ("x/pw@h", "***@h"),
        # A well-formed URL keeps its user name.
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("see url=redis://:pw@h:1/0", "see url=redis://:***@h:1/0"),
        # A name before an "@" that cannot hold a password is left alone.
        ("held by celery@worker-1.example", "held by celery@worker-1.example"),
        ("no at sign here: redis://h:1/0", "no at sign here: redis://h:1/0"),
    ],
)
def test_malformed_locations_are_masked_and_stay_readable(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_a_short_secret_of_a_configured_location_is_masked_before_its_at(settings: Any) -> None:
    """A location with no separator ("pw@host") matches no pattern: its user
    information is known from the settings, and masked where it stands before "@"."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "short": {"BACKEND": REDIS, "LOCATION": "pw@127.0.0.1:1"},
        "plain": {"BACKEND": REDIS, "LOCATION": "Kq7longsecret@127.0.0.1:1"},
    }
    assert redact("LOCATION 'pw@127.0.0.1:1' is bad") == "LOCATION '***@127.0.0.1:1' is bad"
    assert redact("a parser quoted Kq7longsecret alone") == "a parser quoted *** alone"
    # Elsewhere the same letters are not a secret, nor is the scheme, host or port of
    # a configured location.
    assert redact("pw is short for password") == "pw is short for password"
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "url": {"BACKEND": REDIS, "LOCATION": "redis//:Kq7@h:1/0"},
    }
    assert redact("LOCATION 'redis//:Kq7@h:1/0'") == "LOCATION 'redis//***@h:1/0'"
    assert redact("redis://127.0.0.1:1/0 and redis:/h:1") == "redis://127.0.0.1:1/0 and redis:/h:1"


#: Ways a message may show a location: whole, quoted, in a list, or cut into the
#: pieces a parser makes of it (by comma, at every delimiter, percent-decoded).
RENDERINGS: dict[str, Any] = {
    "whole": str,
    "repr": repr,
    "in a message": lambda location: f"LOCATION {location!r}: bad",
    "in a list": lambda location: repr([location]),
    "comma items": lambda location: repr(location.split(",")),
    "parser pieces": lambda location: repr(re.split(r"[/?#@:;&=,\s\\]+", location)),
    "decoded pieces": lambda location: repr(re.split(r"[/?#@:;&=,\s\\]+", unquote(location))),
}


@hypothesis_settings(max_examples=300, deadline=None)
@given(case=secret_locations(), rendering=st.sampled_from(sorted(RENDERINGS)))
def test_no_configured_malformed_location_shows_its_secret(
    case: tuple[str, str], rendering: str
) -> None:
    """Whatever its shape, a configured location shown whole, quoted, in a list or cut
    into pieces shows nothing of its secret, and what follows its last "@" (host,
    port, path) stays readable."""
    core, location = case
    with override_settings(
        DISTLOCKS_BACKENDS={"default": {"BACKEND": REDIS, "LOCATION": location}}
    ):
        text = redact(RENDERINGS[rendering](location))
        assert core[1:] not in text
        if rendering == "whole":
            assert text.endswith("@" + location.rpartition("@")[2])


def test_a_driver_log_record_is_redacted_whatever_the_case(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """kazoo reads "redisKq7secret/@host" as the host "redisKq7secret" (and a chroot),
    and logs it lowercased when it does not resolve: the record is redacted too."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        "zk-bad": {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": "redisKq7secret/@127.0.0.1:1",
        },
    }
    caplog.set_level(logging.DEBUG)
    logging.getLogger("kazoo.client").warning("Cannot resolve %s: no", "rediskq7secret")
    assert caplog.records
    assert "kq7secret" not in caplog.text.lower()
