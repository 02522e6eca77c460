from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core.signals import setting_changed
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate
from django.utils.translation import gettext_lazy as _


class DistlocksConfig(AppConfig):
    name = "distlocks"
    verbose_name = _("Distributed locks")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from distlocks import checks  # noqa: F401 - registers the system checks
        from distlocks.conf import conf
        from distlocks.fencing import install_error_translation
        from distlocks.handler import reset_on_setting_change
        from distlocks.redaction import install_log_redaction

        # No log line of distlocks shows a password, whatever the handlers.
        install_log_redaction()
        setting_changed.connect(reset_on_setting_change, dispatch_uid="distlocks-reset-backends")
        connection_created.connect(
            install_error_translation, dispatch_uid="distlocks-translate-stale-tokens"
        )
        # Once per migrate run (sent for each app; every app's tables exist by then).
        post_migrate.connect(
            install_fencing_triggers, sender=self, dispatch_uid="distlocks-fencing-triggers"
        )
        if conf.METRICS:
            # Only then is prometheus_client imported (the "prometheus" extra).
            from distlocks.metrics import install

            install()


def install_fencing_triggers(using: str = "default", **kwargs: Any) -> None:
    """After ``migrate``: put the fencing trigger on every concrete FencedModel table,
    on the databases where distlocks enforces fencing (PostgreSQL, SQLite, MySQL)."""
    from django.apps import apps
    from django.db import connections, router

    from distlocks.fencing import TOKEN_COLUMN, enforces, install_trigger
    from distlocks.models import FencedModel

    connection = connections[using]
    if not enforces(connection):
        return
    tables = connection.introspection.table_names()
    for model in apps.get_models():
        meta = model._meta
        if not (
            issubclass(model, FencedModel)
            and not meta.proxy
            and meta.managed
            and meta.db_table in tables
            and router.allow_migrate_model(using, model)
        ):
            continue
        # Only where the column exists yet (its migration may be unapplied, or
        # migrated backwards); E010 reports models that cannot be fenced.
        with connection.cursor() as cursor:
            columns = {
                c.name
                for c in connection.introspection.get_table_description(cursor, meta.db_table)
            }
        if TOKEN_COLUMN in columns:
            install_trigger(connection, meta.db_table)
