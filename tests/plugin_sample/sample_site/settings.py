"""Test settings of the sample project.

The test database is a PostgreSQL server: the one DISTLOCKS_TEST_DATABASE_URL names, or a
throwaway one started here (Django sets the test database up before any fixture runs, so
the server has to be known when the settings load). Redis comes from the distlocks
plugin's fixtures, for the tests that ask for it.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from distlocks.testing.servers import ensure_test_servers

_, DATABASE_URL = ensure_test_servers(redis=False)
_url = urlsplit(DATABASE_URL)

SECRET_KEY = "plugin-sample-not-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "distlocks",
    "shop",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "plugin_sample",
        "USER": unquote(_url.username or "postgres"),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": _url.port or 5432,
        # A name of its own per run: runs may share a server given by the variable.
        "TEST": {"NAME": f"test_plugin_sample_{os.getpid()}"},
    }
}
# The project's own backends. Nothing listens on this port: a test that takes a lock
# without one of the plugin's fixtures (which replace "default") fails.
DISTLOCKS_BACKENDS = {
    "default": {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": "redis://127.0.0.1:1/0",
    },
}
