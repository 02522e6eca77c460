"""The Celery app of tests/test_celery_fold.py: ``celery -A tests.celery_fold_app worker``.

Its tasks (:mod:`tests.celery_fold_tasks`, imported once Django is set up) keep their
run locks and queue markers on the broker's own Redis database (the ``"broker-db"``
backend of :mod:`tests.celery_fold_settings`), where a marker's script publishes the
message too.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.celery_fold_settings")

#: The queue of these tasks, consumed only by the workers of the fold tests.
QUEUE = "distlocks-tests-fold"

app = Celery("distlocks-tests-fold", include=["tests.celery_fold_tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_default_queue = QUEUE
