"""The Celery app of the claim proof (tests/test_claims.py): ``celery -A
tests.claim_celery_app worker``. Its own app and queues, on the test session's Redis
broker (``CELERY_*`` of ``tests.settings``), so no other test's worker takes its tasks.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("distlocks-claims", include=["tests.claim_tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
