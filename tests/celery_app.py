"""The Celery app of the test suite: ``celery -A tests.celery_app worker``.

Configured from ``tests.settings`` (``CELERY_*``): a real Redis broker on the
throwaway server the test session started.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("distlocks-tests", include=["tests.testapp.tasks", "tests.celery_tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
