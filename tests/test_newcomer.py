"""What a Django engineer meeting distlocks for the first time runs into.

Each test is a mistake a newcomer made while following the docs word for word (a setting
misspelt, an app left out of INSTALLED_APPS, a number out of range in a Celery option),
and checks that the message they get says what to change.
"""

from __future__ import annotations

import ast
import asyncio
import html
import http.server
import math
import threading
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.test import override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks import alock, get_backend, lock
from distlocks.checks import check_settings
from distlocks.conf import DEFAULTS
from distlocks.contrib.celery import single_execution
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.livelocks.collection import describe_error
from distlocks.validation import validate_ttl

REDIS = {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": "redis://127.0.0.1"}
KNOWN = {*DEFAULTS, "DISTLOCKS_BACKENDS"}


def messages(**overrides: Any) -> list[Any]:
    overrides.setdefault("DISTLOCKS_BACKENDS", {"default": REDIS})
    with override_settings(**overrides):
        return list(check_settings())


# -- settings checks ----------------------------------------------------------------


def test_the_e001_example_is_a_valid_setting_to_paste() -> None:
    (error,) = messages(DISTLOCKS_BACKENDS=None)
    assert error.id == "distlocks.E001"
    example = error.hint.split("DISTLOCKS_BACKENDS = ", 1)[1].rstrip(".")
    value = ast.literal_eval(example)  # "}}}}" would be a SyntaxError here
    assert value["default"]["BACKEND"] == "distlocks.backends.redis.RedisBackend"


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("DISTLOCKS_DEFAULT_TIMOUT", "DISTLOCKS_DEFAULT_TIMEOUT"),
        ("DISTLOCKS_DEFAULT_TTLS", "DISTLOCKS_DEFAULT_TTL"),
        ("DISTLOCKS_STUCK_AFTR", "DISTLOCKS_STUCK_AFTER"),
        ("DISTLOCKS_BACKEND", "DISTLOCKS_BACKENDS"),
        ("DISTLOCK_BACKENDS", "DISTLOCKS_BACKENDS"),
        ("DISTLOCKS_RELEASE_ON_COMMITS", "DISTLOCKS_RELEASE_ON_COMMIT"),
    ],
)
def test_a_misspelt_setting_is_named_with_the_one_meant(typo: str, meant: str) -> None:
    found = [m for m in messages(**{typo: 5}) if m.id == "distlocks.W005"]
    assert len(found) == 1
    assert typo in found[0].hint and meant in found[0].hint


@hsettings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(suffix=st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", min_size=1, max_size=30))
def test_every_unknown_distlocks_setting_is_warned_about_once(suffix: str) -> None:
    setting = f"DISTLOCKS_{suffix}"
    warned = [m for m in messages(**{setting: 1}) if m.id == "distlocks.W005"]
    if setting in KNOWN:
        assert warned == [] or setting not in warned[0].hint
    else:
        assert len(warned) == 1 and setting in warned[0].hint


def test_the_documented_settings_give_no_warning() -> None:
    assert [m.id for m in messages(**{name: DEFAULTS[name] for name in DEFAULTS})] == []


def test_the_misspelt_setting_warning_runs_with_manage_py_check() -> None:
    with override_settings(DISTLOCKS_DEFAULT_TIMOUT=5):
        assert "distlocks.W005" in [m.id for m in run_checks(tags=["distlocks"])]


@pytest.mark.parametrize("value", ["no", 0, 1, None, "False"])
def test_release_on_commit_must_be_a_bool(value: object) -> None:
    found = [m for m in messages(DISTLOCKS_RELEASE_ON_COMMIT=value) if m.id == "distlocks.E013"]
    assert len(found) == 1 and repr(value) in found[0].hint


@pytest.mark.parametrize("value", [True, False])
def test_release_on_commit_true_or_false_is_fine(value: bool) -> None:
    assert messages(DISTLOCKS_RELEASE_ON_COMMIT=value) == []


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (
            {"backend": REDIS["BACKEND"], "location": REDIS["LOCATION"]},
            ["'backend'", "'BACKEND'"],
        ),
        ("redis://127.0.0.1:6379/0", ["str", "'LOCATION': 'redis://127.0.0.1:6379/0'"]),
        ({"LOCATION": "redis://127.0.0.1:6379/0"}, ["no 'BACKEND'", "RedisBackend"]),
        ({"BACKEND": 5}, ["BACKEND", "int"]),
    ],
)
def test_e002_says_what_is_wrong_with_the_entry(entry: object, says: list[str]) -> None:
    (error,) = messages(DISTLOCKS_BACKENDS={"default": entry})
    assert error.id == "distlocks.E002"
    for text in says:
        assert text in error.hint


def test_e002_never_shows_a_password_of_a_bare_url() -> None:
    (error,) = messages(DISTLOCKS_BACKENDS={"default": "redis://:hunter2@127.0.0.1/0"})
    assert "hunter2" not in error.hint and "hunter2" not in error.msg


# -- the PostgreSQL backend used without the app installed --------------------------


def test_a_missing_registry_without_the_app_installed_says_to_install_it() -> None:
    backend = get_backend("pg")
    cause = psycopg.errors.UndefinedFunction("function distlocks_mint(...) does not exist")
    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth"]):
        message = str(backend._driver_error("acquire", "x", cause))
    assert "INSTALLED_APPS" in message and "migrate distlocks" in message


def test_a_missing_registry_with_the_app_installed_says_to_migrate() -> None:
    backend = get_backend("pg")
    cause = psycopg.errors.UndefinedFunction("function distlocks_mint(...) does not exist")
    message = str(backend._driver_error("acquire", "x", cause))
    assert "migrate distlocks" in message and "INSTALLED_APPS" not in message


# -- numbers that are not lease lengths are named as what they are ---------------------


@pytest.mark.parametrize("value", [0, -1, 0.001])
def test_max_hold_errors_name_max_hold_and_not_the_lease_length(value: float) -> None:
    with pytest.raises(ValueError) as excinfo:
        lock("newcomer:max-hold", max_hold=value)
    message = str(excinfo.value)
    assert message.startswith("max_hold ") and "lease length" not in message
    assert "0.01" in message


@pytest.mark.parametrize("option", ["retry_countdown", "unique_ttl", "lock_at_least_for"])
@pytest.mark.parametrize("value", [0, -5, math.nan])
def test_celery_options_errors_name_the_option(option: str, value: float) -> None:
    with pytest.raises(ValueError) as excinfo:
        single_execution(key="newcomer:{a}", **{option: value})(lambda a: a)
    assert str(excinfo.value).startswith(f"{option} ")


def test_validate_ttl_keeps_its_message_for_ttl() -> None:
    with pytest.raises(ValueError, match="ttl must be > 0 seconds"):
        validate_ttl(0)


# -- the admin's banner for a backend that cannot be read -------------------------------


def test_a_drivers_multi_line_error_reads_as_one_line_on_the_page() -> None:
    """libpq lays its messages out on several lines ("Connection refused\\n\\tIs the
    server running..."): the banner showed them as \\x0a\\x09 escapes. Line breaks and
    tabs become spaces; other control characters are still escaped."""
    error = LockBackendUnavailable(
        "pg", "port 1 failed: Connection refused\n\tIs the server running on that host?\x1b[31m"
    )
    shown = describe_error(error)
    assert "Connection refused Is the server running on that host?" in shown
    assert "\\x0a" not in shown and "\\x09" not in shown and "\n" not in shown
    assert "\\x1b[31m" in shown


# -- transaction mode from alock() --------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_alock_on_a_transaction_mode_alias_says_alock_cannot_use_it(pg_ready: None) -> None:
    """The message said only "must be taken inside transaction.atomic()", which no
    coroutine can do for the worker thread alock() runs the call in."""

    async def take() -> None:
        async with alock("newcomer:xact", backend="pgx", timeout=0):
            pass

    with pytest.raises(LockError, match=r"alock\(\)") as excinfo:
        asyncio.run(take())
    assert "sync_to_async" in str(excinfo.value)


# -- a misspelt option in a Redis LOCATION's query string --------------------------------


@pytest.mark.parametrize(
    ("location", "typo", "meant"),
    [
        ("redis://127.0.0.1:6379/0?socket_timout=1", "socket_timout", "socket_timeout"),
        ("redis://:pw@127.0.0.1/0?health_check_intervl=30", "health_check_intervl", None),
        ("rediss://127.0.0.1/0?ssl_cert_req=none", "ssl_cert_req", "ssl_cert_reqs"),
        ("unix:///tmp/redis.sock?db=0&bogus=1", "bogus", None),
        ("redis+sentinel://127.0.0.1:26379/main/0?socket_timout=1", "socket_timout", None),
        ("redis+cluster://127.0.0.1:7000?read_from_replica=true", "read_from_replica", None),
    ],
)
def test_an_unknown_location_query_option_is_caught_by_the_check(
    location: str, typo: str, meant: str | None
) -> None:
    """redis-py hands any query key to the connection class, which raised a bare
    TypeError at the first lock, after `manage.py check` had said nothing."""
    found = [
        m
        for m in messages(DISTLOCKS_BACKENDS={"default": {**REDIS, "LOCATION": location}})
        if m.id == "distlocks.E004"
    ]
    assert len(found) == 1 and typo in found[0].hint
    assert meant is None or meant in found[0].hint
    assert ":pw@" not in found[0].hint


@pytest.mark.parametrize(
    "location",
    [
        "redis://127.0.0.1:6379/0?socket_timeout=1&socket_connect_timeout=0.5",
        "redis://127.0.0.1/0?health_check_interval=30&max_connections=50&client_name=web",
        "rediss://127.0.0.1/0?ssl_cert_reqs=none&ssl_check_hostname=false",
        "unix:///tmp/redis.sock?db=2&socket_timeout=1",
        "redis+sentinel://:pw@127.0.0.1:26379/main/1?socket_timeout=1&health_check_interval=5",
        "rediss+sentinel://127.0.0.1:26379/main?ssl_cert_reqs=none",
        "redis+cluster://127.0.0.1:7000?socket_timeout=1&read_from_replicas=true",
    ],
)
def test_the_query_options_redis_reads_pass_the_check(location: str) -> None:
    assert messages(DISTLOCKS_BACKENDS={"default": {**REDIS, "LOCATION": location}}) == []


def test_an_unknown_query_option_is_improperly_configured_at_the_first_lock() -> None:
    entry = {**REDIS, "LOCATION": "redis://127.0.0.1:6379/0?socket_timout=1"}
    with override_settings(DISTLOCKS_BACKENDS={"default": entry}):
        with pytest.raises(ImproperlyConfigured, match="socket_timout"):
            lock("newcomer:query", timeout=0).acquire()


# -- an unreachable PostgreSQL server, asked about one lock -------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda backend: backend.inspect("newcomer:inspect"),
        lambda backend: backend.permit_holders("semaphore", "newcomer:inspect"),
    ],
)
def test_inspecting_a_lock_on_a_server_down_names_the_lock_not_sql(call: Any) -> None:
    """The message named an SQL fragment (" AND lkey = %s AND mode = 'ExclusiveLock'")
    where the lock's name belongs."""
    down = {**connections.settings["default"], "PORT": 1}
    connections.settings["newcomer-down"] = down
    entry = {"BACKEND": "distlocks.backends.postgres.PostgresBackend", "DATABASE": "newcomer-down"}
    try:
        with override_settings(
            DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "down": entry},
        ):
            with pytest.raises(LockBackendUnavailable) as excinfo:
                call(get_backend("down"))
    finally:
        del connections.settings["newcomer-down"]
    message = str(excinfo.value)
    assert "newcomer:inspect" in message
    assert "%s" not in message and "AND" not in message


# -- a LOCATION that names a server which is not Redis -----------------------------------


def test_a_location_that_names_an_http_server_says_so() -> None:
    """A Redis LOCATION pointing at a web server's port (a wrong port, etcd's, a proxy's)
    answered with redis-py's "Protocol error, got 'H' as reply type byte", which says
    nothing of what to change."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    entry = {**REDIS, "LOCATION": f"redis://127.0.0.1:{server.server_address[1]}/0"}
    try:
        with override_settings(DISTLOCKS_BACKENDS={"default": entry}):
            with pytest.raises(LockError) as excinfo:
                lock("newcomer:http", timeout=0).acquire()
    finally:
        server.shutdown()
        server.server_close()
    assert "not a Redis server" in str(excinfo.value)
    assert "LOCATION" in str(excinfo.value)


# -- the operator's page of a lock, reached with a wrong or missing backend --------------


@pytest.mark.django_db
@pytest.mark.parametrize("query", [{"name": "x"}, {"backend": "nope", "name": "x"}])
def test_a_lock_page_without_a_known_backend_names_the_backends_there_are(
    admin_client: Any, query: dict[str, str]
) -> None:
    """ "There is no backend ''." said neither that the request named no backend nor
    which ones there are."""
    response = admin_client.get("/admin/distlocks/livelock/lock/", query, follow=True)
    assert response.status_code == 200
    text = html.unescape(response.content.decode())
    assert "DISTLOCKS_BACKENDS defines 'default'" in text
    if "backend" not in query:
        assert "names no backend" in text
