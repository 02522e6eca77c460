"""Settings for the test suite.

Importing this module starts throwaway Redis and PostgreSQL servers unless
DISTLOCKS_TEST_REDIS_URL / DISTLOCKS_TEST_DATABASE_URL name existing ones; the
URLs are exported, so the worker processes that tests start reuse the servers.
"""

from __future__ import annotations

import os
import sys
from urllib.parse import unquote, urlsplit

from distlocks.testing.servers import ensure_redlock_test_servers, ensure_test_servers

#: The variables this module sets when it starts a server or makes a file itself (those
#: set beforehand name servers of the caller's, used as they are).
_SESSION_VARIABLES = (
    "DISTLOCKS_TEST_REDIS_URL",
    "DISTLOCKS_TEST_DATABASE_URL",
    "DISTLOCKS_TEST_REDLOCK_URLS",
    "DISTLOCKS_TEST_SQLITE_PATH",
)
_STARTED_HERE = "DISTLOCKS_TEST_STARTED"
_SERVERS_OF = "DISTLOCKS_TEST_SERVERS_OF"


def _servers_of_this_worker() -> None:
    """Under pytest-xdist (``make test`` runs two workers) each worker has servers of its
    own, since tests stop, restart and count the keys of the session's servers. A worker
    inherits the controller's environment: it forgets the servers the controller started
    (not the ones the caller named) and starts its own. Processes that a worker's tests
    start inherit its variables and so use its servers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get(_SERVERS_OF, "") == worker:
        return
    for variable in os.environ.get(_STARTED_HERE, "").split(","):
        os.environ.pop(variable, None)
    os.environ.pop(_STARTED_HERE, None)
    os.environ[_SERVERS_OF] = worker


def _xdist_controller() -> bool:
    """The controller of a pytest-xdist run (``-n 2``): it runs no test, and each worker
    starts servers of its own, so servers started here would only idle all session."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return False
    # Only pytest itself with xdist loaded: a process a test starts may take "-n" for
    # something else (a Celery worker's node name).
    if "xdist" not in sys.modules or "pytest" not in sys.modules:
        return False
    args = [*sys.argv[1:], *os.environ.get("PYTEST_ADDOPTS", "").split()]
    for i, arg in enumerate(args):
        if arg in ("-n", "--numprocesses") and i + 1 < len(args):
            return args[i + 1] != "0"
        if arg.startswith("--numprocesses="):
            return arg.partition("=")[2] != "0"
        if arg.startswith("-n") and arg[2:].isalnum():
            return arg[2:] != "0"
    return False


_servers_of_this_worker()
_given = [variable for variable in _SESSION_VARIABLES if os.environ.get(variable)]
if _xdist_controller():
    # Never connected to (no test runs here); not exported, so no worker inherits them.
    REDIS_URL, DATABASE_URL = "redis://127.0.0.1:9/0", "postgresql://postgres@127.0.0.1:9/postgres"
    REDLOCK_URLS = [REDIS_URL, "redis://127.0.0.1:9/1", "redis://127.0.0.1:9/2"]
else:
    REDIS_URL, DATABASE_URL = ensure_test_servers()
    # Redlock's three masters: the test Redis server and two more of its own.
    REDLOCK_URLS = [REDIS_URL, *ensure_redlock_test_servers(2)]


def _database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        # Worker processes started by tests are pointed at the test database.
        "NAME": os.environ.get("DISTLOCKS_TEST_DB_NAME", "distlocks"),
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": parts.port or 5432,
        "TEST": {"NAME": "test_distlocks"},
    }


SECRET_KEY = "distlocks-tests-not-secret"
# The tests' users have throwaway passwords: a fast hash instead of PBKDF2's 1.2 million
# rounds (0.3-0.9 s on a loaded 2-core machine, for every user a test creates).
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.urls"
# pytest-django's live_server needs it (its static-files handler reads it).
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "distlocks",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {"default": _database(DATABASE_URL)}


def _sqlite_path() -> str:
    """A SQLite file for the "sqlite" alias (tests/test_fencing_sqlite.py), in a temp
    dir exported like the server URLs, so worker processes open the same file."""
    path = os.environ.get("DISTLOCKS_TEST_SQLITE_PATH")
    if not path:
        import atexit
        import shutil
        import tempfile

        directory = tempfile.mkdtemp(prefix="distlocks-sqlite-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        path = os.environ["DISTLOCKS_TEST_SQLITE_PATH"] = os.path.join(directory, "fenced.db")
    return path


# Only the tests that declare it use it (pytest-django sets up no other alias); the
# test database is this same file, created afresh by the test run.
DATABASES["sqlite"] = {
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": _sqlite_path(),
    # No DEPENDENCIES: its tests need no other database set up first.
    "TEST": {"NAME": _sqlite_path(), "DEPENDENCIES": []},
}
# What this process started (see _servers_of_this_worker).
os.environ[_STARTED_HERE] = ",".join(v for v in _SESSION_VARIABLES if v not in _given)

# MariaDB (tests/test_fencing_mariadb.py): its fixture starts a server and exports
# this URL for worker processes; set it beforehand to use an existing server (a
# database of its own for the tests: they create their tables in it).
if os.environ.get("DISTLOCKS_TEST_MARIADB_URL"):
    import importlib.util

    from distlocks.testing.servers import mariadb_database_settings

    # Django's MySQL backend imports MySQLdb (mysqlclient, which needs C headers to
    # build); PyMySQL stands in for it.
    if importlib.util.find_spec("MySQLdb") is None and importlib.util.find_spec("pymysql"):
        import pymysql

        pymysql.install_as_MySQLdb()

    DATABASES["mariadb"] = mariadb_database_settings(os.environ["DISTLOCKS_TEST_MARIADB_URL"])

CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
    },
}

DISTLOCKS_BACKENDS = {
    "default": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": REDIS_URL},
    "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": REDIS_URL},
    "locmem": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},
    "pg": {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "default",
        "OPTIONS": {"pool_size": 64},
    },
    "pgx": {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "default",
        "OPTIONS": {"mode": "transaction"},
    },
    "zk": {
        "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
        # Set by the zk_ready fixture (tests/conftest.py) when it starts a server.
        "LOCATION": os.environ.get("DISTLOCKS_TEST_ZOOKEEPER", "127.0.0.1:2181"),
        "OPTIONS": {"session_timeout": 4},
    },
    "redlock": {
        "BACKEND": "distlocks.backends.redlock.RedlockBackend",
        "LOCATION": REDLOCK_URLS,
        # A prefix of its own: its first master is the "redis" alias's server.
        "OPTIONS": {"key_prefix": "distlocks-test-redlock"},
    },
}
DISTLOCKS_KEY_PREFIX = "distlocks-test"


def etcd_alias(location: str) -> dict[str, object]:
    """The "etcd" alias for an etcd at ``location``."""
    return {
        "BACKEND": "distlocks.backends.etcd.EtcdBackend",
        "LOCATION": location,
        "OPTIONS": {"connect_timeout": 2, "socket_timeout": 5},
    }


# etcd: the etcd_ready fixture (tests/conftest.py) starts a server, adds the alias and
# exports its URL here, so worker processes get it too. Set the variable beforehand to
# use an existing server. No alias otherwise: the command's and the admin page's
# listings of every backend would meet an etcd that is not there.
if os.environ.get("DISTLOCKS_TEST_ETCD"):
    DISTLOCKS_BACKENDS["etcd"] = etcd_alias(os.environ["DISTLOCKS_TEST_ETCD"])


def _redis_db(url: str, db: int) -> str:
    return urlsplit(url)._replace(path=f"/{db}").geturl()


# Celery (tests/celery_app.py): the broker and the results are databases of the test
# Redis server, so worker processes started by tests share them.
CELERY_BROKER_URL = _redis_db(REDIS_URL, 1)
CELERY_RESULT_BACKEND = _redis_db(REDIS_URL, 2)
CELERY_TASK_DEFAULT_QUEUE = "distlocks-tests"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "root": {"handlers": ["null"], "level": "WARNING"},
}
