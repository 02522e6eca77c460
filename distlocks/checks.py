"""System checks for distlocks settings. Settings only: no check opens a connection."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from distlocks.conf import conf
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
W001 = "LocMemBackend only locks within one process."


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
    errors.extend(_check_operations())
    # Settings are quoted in these messages, and a LOCATION may hold a password.
    for error in errors:
        error.msg = redact(error.msg)
        if error.hint:
            error.hint = redact(error.hint)
    return errors


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
                "'redis://127.0.0.1:6379/0'}}}}.",
                id="distlocks.E001",
            )
        ]
    errors: list[CheckMessage] = []
    for alias, config in value.items():
        if not isinstance(config, Mapping) or not isinstance(config.get("BACKEND"), str):
            errors.append(
                Error(E002, hint=f"Fix DISTLOCKS_BACKENDS[{alias!r}].", id="distlocks.E002")
            )
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
