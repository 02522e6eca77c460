"""System checks for distlocks settings. Settings only: no check opens a connection."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from distlocks.conf import DEFAULTS, conf
from distlocks.handler import backend_class
from distlocks.redaction import redact
from distlocks.validation import MAX_TIMEOUT, MAX_TTL

# Every message distlocks can emit, kept together so the IDs are easy to audit.
E001 = "DISTLOCKS_BACKENDS must be a dict of alias -> backend config with a 'default' alias."
E002 = "A DISTLOCKS_BACKENDS entry must be a dict with a 'BACKEND' dotted path."
E003 = "A DISTLOCKS_BACKENDS 'BACKEND' must import as a BaseBackend subclass."
E004 = "A DISTLOCKS_BACKENDS entry is not valid for its backend class."
E005 = (
    f"DISTLOCKS_DEFAULT_TTL must be a number of seconds from 0.01 to {MAX_TTL:,} "
    f"({MAX_TTL // 86400} days, distlocks.validation.MAX_TTL)."
)
E006 = (
    f"DISTLOCKS_DEFAULT_TIMEOUT must be None or a number of seconds from 0 to {MAX_TIMEOUT:,} "
    f"({MAX_TIMEOUT // 86400} days, distlocks.validation.MAX_TIMEOUT)."
)
E007 = "DISTLOCKS_KEY_PREFIX must be a non-empty str without braces."
E008 = "PostgresBackend needs a PostgreSQL database."
E009 = "Session-mode PostgreSQL locks cannot work behind transaction pooling."
E010 = "A FencedModel subclass must keep fencing_token as a non-null BigIntegerField."
E011 = "DISTLOCKS_STUCK_AFTER must be a number of seconds > 0."
E012 = "DISTLOCKS_METRICS must be True or False, and True needs prometheus_client."
E013 = "DISTLOCKS_RELEASE_ON_COMMIT must be True or False."
W001 = "LocMemBackend only locks within one process."
W003 = "A FencedModel is registered in the admin with a ModelAdmin that does not fence its saves."
W004 = "A fenced table has no fencing trigger: the database does not refuse stale writes to it."
W005 = "A DISTLOCKS_* setting that distlocks does not read (a misspelt name?)."
W006 = "A FencedModel's default manager is not a FencedManager over a FencedQuerySet."


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    # An int of any size is finite (and math.isnan would overflow on a huge one).
    return isinstance(value, int) or math.isfinite(value)


@register(Tags.compatibility, "distlocks")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    errors.extend(_check_backends())
    ttl = conf.DEFAULT_TTL
    if not _is_number(ttl) or not 0.01 <= ttl <= MAX_TTL:
        errors.append(Error(E005, hint=f"It is {ttl!r}; set it to e.g. 30.", id="distlocks.E005"))
    timeout = conf.DEFAULT_TIMEOUT
    if timeout is not None and (not _is_number(timeout) or not 0 <= timeout <= MAX_TIMEOUT):
        errors.append(
            Error(
                E006,
                hint=f"It is {timeout!r}; use None to wait forever, 0 to try once, "
                "or a number of seconds.",
                id="distlocks.E006",
            )
        )
    prefix = conf.KEY_PREFIX
    if not isinstance(prefix, str) or not prefix or set("{}") & set(prefix):
        errors.append(Error(E007, hint=f"It is {prefix!r}; e.g. 'distlocks'.", id="distlocks.E007"))
    release_on_commit = conf.RELEASE_ON_COMMIT
    if not isinstance(release_on_commit, bool):
        # Read as a condition, "no" or "False" (an environment variable) would be true.
        errors.append(
            Error(
                E013,
                hint=f"It is {release_on_commit!r}, which is not a bool. Set it to True "
                "(the default) or False.",
                id="distlocks.E013",
            )
        )
    errors.extend(_check_operations())
    errors.extend(_check_unknown_settings())
    # Settings are quoted in these messages, and a LOCATION may hold a password.
    for error in errors:
        error.msg = redact(error.msg)
        if error.hint:
            error.hint = redact(error.hint)
    return errors


def _entry_hint(alias: str, config: Any) -> str:
    """What is wrong with an entry that has no usable 'BACKEND'."""
    where = f"DISTLOCKS_BACKENDS[{alias!r}]"
    if isinstance(config, str):
        # A bare URL, as some cache and broker settings take: show the dict it belongs in.
        return (
            f"{where} is a str; it must be a dict, e.g. {{'BACKEND': "
            f"'distlocks.backends.redis.RedisBackend', 'LOCATION': {config!r}}}."
        )
    if not isinstance(config, Mapping):
        return f"{where} is a {type(config).__name__}; it must be a dict with a 'BACKEND' key."
    if "BACKEND" in config:
        return (
            f"{where}['BACKEND'] is a {type(config['BACKEND']).__name__}; it must be the "
            "dotted path of a backend class as a str, e.g. "
            "'distlocks.backends.redis.RedisBackend'."
        )
    keys = ", ".join(repr(key) for key in config) or "no keys"
    return (
        f"{where} has no 'BACKEND' key (it has {keys}); keys are upper case: 'BACKEND', "
        "then 'LOCATION' or 'DATABASE', and 'OPTIONS'. E.g. 'BACKEND': "
        "'distlocks.backends.redis.RedisBackend'."
    )


def _check_unknown_settings() -> list[CheckMessage]:
    """A misspelt setting is otherwise ignored without a word, its default used."""
    known = [*DEFAULTS, "DISTLOCKS_BACKENDS"]
    warnings: list[CheckMessage] = []
    for name in dir(settings):
        if name in known or not name.startswith(("DISTLOCKS_", "DISTLOCK_")):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        meant = f"Did you mean {close[0]}? " if close else ""
        warnings.append(
            Warning(
                W005,
                hint=f"{name} is set, but distlocks reads no such setting. {meant}"
                f"distlocks reads {', '.join(sorted(known))}.",
                id="distlocks.W005",
            )
        )
    return warnings


def _check_operations() -> list[CheckMessage]:
    """The settings of the live-locks page and of the metrics."""
    errors: list[CheckMessage] = []
    stuck = conf.STUCK_AFTER
    if not _is_number(stuck) or stuck <= 0:
        errors.append(
            Error(E011, hint=f"It is {stuck!r}; e.g. 3600 (one hour).", id="distlocks.E011")
        )
    metrics = conf.METRICS
    if not isinstance(metrics, bool):
        errors.append(Error(E012, hint=f"It is {metrics!r}.", id="distlocks.E012"))
    elif metrics:
        import importlib.util

        if importlib.util.find_spec("prometheus_client") is None:
            errors.append(
                Error(
                    E012,
                    hint="prometheus_client is not installed: pip install "
                    "'distlocks[prometheus]', or set DISTLOCKS_METRICS = False.",
                    id="distlocks.E012",
                )
            )
    return errors


def _check_backends() -> list[CheckMessage]:
    value = conf.BACKENDS
    if not isinstance(value, Mapping) or "default" not in value:
        got = "not set" if value is None else redact(repr(value))[:80]
        return [
            Error(
                E001,
                hint=f"It is {got}. Example: DISTLOCKS_BACKENDS = {{'default': {{'BACKEND': "
                "'distlocks.backends.redis.RedisBackend', 'LOCATION': "
                "'redis://127.0.0.1:6379/0'}}.",
                id="distlocks.E001",
            )
        ]
    errors: list[CheckMessage] = []
    for alias, config in value.items():
        if not isinstance(config, Mapping) or not isinstance(config.get("BACKEND"), str):
            errors.append(Error(E002, hint=_entry_hint(alias, config), id="distlocks.E002"))
            continue
        try:
            cls = backend_class(alias, config)
        except ImproperlyConfigured as exc:
            errors.append(Error(E003, hint=str(exc), id="distlocks.E003"))
            continue
        # Backend-specific messages (E004, and E008/E009 for PostgreSQL).
        try:
            errors.extend(cls.check_config(alias, config))
        except Exception as exc:  # a check that crashes must not stop manage.py check
            errors.append(
                Error(
                    E004,
                    hint=f"DISTLOCKS_BACKENDS[{alias!r}]: {type(exc).__name__}: {exc}",
                    id="distlocks.E004",
                )
            )
        if config["BACKEND"].endswith(".LocMemBackend") and not settings.DEBUG:
            errors.append(
                Warning(
                    W001,
                    hint=f"DISTLOCKS_BACKENDS[{alias!r}] uses LocMemBackend with DEBUG=False: "
                    "other processes and servers do not see its locks. Use RedisBackend or "
                    "PostgresBackend in production.",
                    id="distlocks.W001",
                )
            )
    return errors


@register(Tags.models, "distlocks")
def check_fenced_models(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from django.apps import apps
    from django.core.exceptions import FieldDoesNotExist
    from django.db import models

    from distlocks.models import FencedModel

    configs = app_configs or apps.get_app_configs()
    errors: list[CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel) or model._meta.abstract or model._meta.proxy:
                continue
            try:
                field = model._meta.get_field("fencing_token")
            except FieldDoesNotExist:
                field = None
            problem = ""
            if not isinstance(field, models.BigIntegerField) or field.null:
                problem = "removed" if field is None else f"a {type(field).__name__}"
                if field is not None and field.null:
                    problem += " with null=True"
            elif field.column != "fencing_token":
                problem = f"stored in column {field.column!r} (the triggers expect 'fencing_token')"
            elif any(link is not None for link in model._meta.parents.values()):
                problem = "inherited through multi-table inheritance (one UPDATE covers one table)"
            if problem:
                got = problem
                errors.append(
                    Error(
                        E010,
                        hint=f"{model._meta.label}.fencing_token is {got}; keep the field "
                        "inherited from FencedModel (fenced saves compare and store it, and "
                        "the trigger migrate installs on PostgreSQL, SQLite and MySQL/MariaDB "
                        "guards the 'fencing_token' column; on MySQL/MariaDB creating it "
                        "needs the TRIGGER privilege and, with binary logging, SUPER or "
                        "log_bin_trust_function_creators = 1).",
                        obj=model,
                        id="distlocks.E010",
                    )
                )
    return errors


@register(Tags.models, "distlocks")
def check_fenced_managers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A FencedModel whose default manager does not fence: Django derives the related
    managers (``account.parcel_set``) from it, and only a FencedManager's refuse
    ``add(bulk=True)``; only a FencedQuerySet refuses ``update()``."""
    from django.apps import apps

    from distlocks.models import FencedManager, FencedQuerySet

    errors: list[CheckMessage] = []
    for config in app_configs or apps.get_app_configs():
        for model in config.get_models():
            if model not in _fenced_models(config):
                continue
            manager = model._default_manager
            queryset = getattr(manager, "_queryset_class", None)
            if isinstance(manager, FencedManager) and (
                isinstance(queryset, type) and issubclass(queryset, FencedQuerySet)
            ):
                continue
            name = getattr(queryset, "__name__", "MyFencedQuerySet")
            errors.append(
                Warning(
                    W006,
                    hint=f"{model._meta.label}'s default manager {manager.name!r} is a "
                    f"{type(manager).__name__} over {name}: its related managers' add() and "
                    f"set() write rows with no token, and an update() without a "
                    f"FencedQuerySet is not refused. Build it with "
                    f"distlocks.models.FencedManager.from_queryset({name})(), {name} "
                    f"subclassing distlocks.models.FencedQuerySet (not as_manager() or "
                    f"models.Manager.from_queryset()).",
                    obj=model,
                    id="distlocks.W006",
                )
            )
    return errors


def _fenced_models(config: Any = None) -> list[type[Any]]:
    from django.apps import apps

    from distlocks.models import FencedModel

    return [
        model
        for model in (config.get_models() if config is not None else apps.get_models())
        if issubclass(model, FencedModel) and not model._meta.abstract
    ]


@register(Tags.admin, "distlocks")
def check_fenced_admins(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A FencedModel under a plain ModelAdmin: its change form would answer 500
    (FencingTokenRequired) on every save, since nothing takes the row's lock."""
    from django.apps import apps

    if not apps.is_installed("django.contrib.admin"):
        return []
    from django.contrib.admin.sites import all_sites

    from distlocks.admin import FencedModelAdmin

    errors: list[CheckMessage] = []
    for site in all_sites:
        for model, model_admin in site._registry.items():
            if model in _fenced_models() and not isinstance(model_admin, FencedModelAdmin):
                errors.append(
                    Warning(
                        W003,
                        hint=f"{model._meta.label} is registered on admin site {site.name!r} "
                        f"with {type(model_admin).__name__}: its change form would fail with "
                        "FencingTokenRequired. Register it with "
                        "distlocks.admin.FencedModelAdmin (or a subclass), which saves under "
                        "the row's lock.",
                        obj=model,
                        id="distlocks.W003",
                    )
                )
    return errors


def missing_triggers(connection: Any, table: str) -> list[str]:
    """The fencing triggers ``table`` should have on ``connection`` but lacks."""
    from distlocks.fencing import trigger_name

    if connection.vendor == "postgresql":
        wanted = [trigger_name(connection, table)]
        sql = "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal"
        params = [connection.ops.quote_name(table)]
    elif connection.vendor == "sqlite":
        wanted = [trigger_name(connection, table), trigger_name(connection, table, insert=True)]
        sql = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s"
        params = [table]
    else:  # mysql / mariadb
        wanted = [trigger_name(connection, table), trigger_name(connection, table, insert=True)]
        sql = (
            "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS "
            "WHERE EVENT_OBJECT_SCHEMA = DATABASE() AND EVENT_OBJECT_TABLE = %s"
        )
        params = [table]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        present = {row[0] for row in cursor.fetchall()}
    return [name for name in wanted if name not in present]


@register(Tags.database, "distlocks")
def check_fencing_triggers(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """With ``manage.py check --database ALIAS`` (and before ``migrate``): every fenced
    table on a database that enforces fencing has its triggers. A table restored from a
    dump or created outside migrations would otherwise take stale writes silently."""
    from django.db import DatabaseError, connections, router

    from distlocks.fencing import TOKEN_COLUMN, enforces

    errors: list[CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if not enforces(connection):
            continue
        try:
            tables = set(connection.introspection.table_names())
            for model in _fenced_models():
                meta = model._meta
                if (
                    meta.proxy
                    or not meta.managed
                    or meta.db_table not in tables
                    or not router.allow_migrate_model(alias, model)
                ):
                    continue
                with connection.cursor() as cursor:
                    columns = {
                        c.name
                        for c in connection.introspection.get_table_description(
                            cursor, meta.db_table
                        )
                    }
                if TOKEN_COLUMN not in columns:
                    continue  # its migration is not applied yet: migrate adds both
                missing = missing_triggers(connection, meta.db_table)
                if missing:
                    errors.append(
                        Warning(
                            W004,
                            hint=f"{meta.label}: table {meta.db_table!r} on database "
                            f"{alias!r} lacks {', '.join(missing)}. Run `python manage.py "
                            f"migrate --database {alias}`: it reinstalls the fencing triggers "
                            "of every fenced table (also when no migration is pending).",
                            obj=model,
                            id="distlocks.W004",
                        )
                    )
        except DatabaseError as exc:
            errors.append(
                Warning(
                    W004,
                    hint=f"Could not read the triggers of database {alias!r}: {redact(str(exc))}",
                    id="distlocks.W004",
                )
            )
    return errors
