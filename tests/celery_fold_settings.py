"""The test settings with a lock backend on the Celery broker's own Redis database
(``"broker-db"``), for the workers of tests/test_celery_fold.py: there a queue
marker's script also publishes the message."""

from __future__ import annotations

from tests.settings import *  # noqa: F403 - these settings, and one alias more
from tests.settings import CELERY_BROKER_URL, DISTLOCKS_BACKENDS

BROKER_DB = {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": CELERY_BROKER_URL}
DISTLOCKS_BACKENDS = {**DISTLOCKS_BACKENDS, "broker-db": BROKER_DB}
