from __future__ import annotations

from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    verbose_name = "distlocks benchmarks"
    default_auto_field = "django.db.models.BigAutoField"
