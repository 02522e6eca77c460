"""The distlocks demo site: ``make demo`` runs :mod:`demo_project.run`."""

from __future__ import annotations

# Loaded with the project, so that the tasks' shared_task decorators bind to this
# app in the web server as in the worker.
from demo_project.celery import app as celery_app

__all__ = ["celery_app"]
