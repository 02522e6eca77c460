from __future__ import annotations

from django.apps import AppConfig
from django.core.signals import setting_changed
from django.utils.translation import gettext_lazy as _


class DistlocksConfig(AppConfig):
    name = "distlocks"
    verbose_name = _("Distributed locks")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from distlocks import checks  # noqa: F401 - registers the system checks
        from distlocks.handler import reset_on_setting_change

        setting_changed.connect(reset_on_setting_change, dispatch_uid="distlocks-reset-backends")
