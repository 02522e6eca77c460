"""Django settings for the benchmarks.

The servers are started (or found through ``DISTLOCKS_TEST_REDIS_URL`` /
``DISTLOCKS_TEST_DATABASE_URL``) by :mod:`bench.run` before Django is set up; the
URLs travel in the environment, so the worker processes it spawns configure
themselves identically.
"""

from __future__ import annotations

import os

from distlocks.testing.servers import DATABASE_URL_ENV, REDIS_URL_ENV

REDIS_URL = os.environ.get(REDIS_URL_ENV, "redis://127.0.0.1:6379/0")
DATABASE_URL = os.environ.get(DATABASE_URL_ENV, "")

SECRET_KEY = "distlocks-bench-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "distlocks",
]

# The Redis workloads need no database; PostgreSQL ones will add it from DATABASE_URL.
DATABASES: dict[str, dict[str, object]] = {}

DISTLOCKS_BACKENDS = {
    "default": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": REDIS_URL},
}
DISTLOCKS_KEY_PREFIX = "distlocks-bench"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "root": {"handlers": ["null"], "level": "WARNING"},
}
