"""The demo's Celery app: ``celery -A demo_project worker`` (or ``beat``).

Configured from the Django settings (the ``CELERY_*`` names in
:mod:`demo_project.settings`): the broker and the result backend are databases
of the demo's Redis server, and the beat schedule sends the periodic job. The
tasks live in :mod:`demo_project.shop.tasks`, found by ``autodiscover_tasks()``.
:mod:`demo_project.run` starts one worker and two beats.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
