"""Backend aliases -> backend instances, created lazily, dropped when settings change."""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from distlocks.backends.base import BaseBackend
from distlocks.backends.capabilities import unwritten
from distlocks.conf import conf
from distlocks.redaction import redact, redact_exception


def backend_configs() -> dict[str, Mapping[str, Any]]:
    """``DISTLOCKS_BACKENDS`` after the structural checks, or ImproperlyConfigured."""
    value = conf.BACKENDS
    if value is None:
        raise ImproperlyConfigured(
            "DISTLOCKS_BACKENDS is not set. Add it to your settings, e.g. "
            "DISTLOCKS_BACKENDS = {'default': {'BACKEND': "
            "'distlocks.backends.redis.RedisBackend', 'LOCATION': 'redis://127.0.0.1:6379/0'}}."
        )
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"DISTLOCKS_BACKENDS must be a dict of alias -> backend config, "
            f"not {type(value).__name__}."
        )
    return dict(value)


#: Driver module (top-level name) -> the distlocks extra that installs it.
DRIVER_EXTRAS = {
    "redis": "redis",
    "hiredis": "redis",
    "django_redis": "redis",
    "psycopg": "postgres",
    "psycopg_binary": "postgres",
    "kazoo": "zookeeper",
    "celery": "celery",
    "prometheus_client": "prometheus",
}


def _extra_hint(exc: BaseException) -> str:
    """ "; install it with pip install 'distlocks[...]'" when ``exc`` (or its cause) is a
    missing driver; "" otherwise."""
    seen: BaseException | None = exc
    while seen is not None:
        name = getattr(seen, "name", None) or ""
        if not name:
            match = re.search(r"(?:module named|import of) '?([A-Za-z_][\w.]*)", str(seen))
            name = match.group(1) if match else ""
        extra = DRIVER_EXTRAS.get(name.partition(".")[0])
        if extra:
            return (
                f". The {name.partition('.')[0]!r} driver is missing: "
                f"pip install 'distlocks[{extra}]'"
            )
        seen = seen.__cause__ or seen.__context__
    return ""


def backend_class(alias: str, config: Any) -> type[BaseBackend]:
    """Import and return the class named by ``config['BACKEND']``."""
    if not isinstance(config, Mapping):
        raise ImproperlyConfigured(
            f"DISTLOCKS_BACKENDS[{alias!r}] must be a dict, not {type(config).__name__}."
        )
    path = config.get("BACKEND")
    if not isinstance(path, str) or not path:
        raise ImproperlyConfigured(
            f"DISTLOCKS_BACKENDS[{alias!r}] has no 'BACKEND'; set it to a dotted path "
            f"such as 'distlocks.backends.redis.RedisBackend'."
        )
    try:
        cls = import_string(path)
    except ImportError as exc:
        redact_exception(exc)
        hint = _extra_hint(exc)
        raise ImproperlyConfigured(
            redact(
                f"DISTLOCKS_BACKENDS[{alias!r}]['BACKEND'] = {path!r} could not be imported: "
                f"{exc}{hint}"
            )
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseBackend)):
        raise ImproperlyConfigured(
            f"DISTLOCKS_BACKENDS[{alias!r}]['BACKEND'] = {path!r} is not a subclass of "
            f"distlocks.backends.base.BaseBackend."
        )
    if getattr(cls, "__abstractmethods__", None):
        # Said here (manage.py check, the first use) rather than by a TypeError when
        # the first request builds it.
        raise ImproperlyConfigured(
            f"DISTLOCKS_BACKENDS[{alias!r}]['BACKEND'] = {path!r} cannot be used: {unwritten(cls)}"
        )
    return cls


def check_alias(alias: str) -> Mapping[str, Any] | None:
    """Raise ImproperlyConfigured, naming the known aliases, unless ``alias`` is one.

    Returns its config (None when the backend already exists: no need to look)."""
    if not isinstance(alias, str):
        raise TypeError(f"backend must be an alias string, not {type(alias).__name__}.")
    if alias in backends._backends:
        return None
    configs = backend_configs()
    if alias not in configs:
        known = ", ".join(repr(a) for a in sorted(configs)) or "none"
        close = difflib.get_close_matches(alias, list(configs), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ImproperlyConfigured(
            f"Unknown distlocks backend alias {alias!r}; {hint}DISTLOCKS_BACKENDS defines {known}."
        )
    return configs[alias]


class BackendHandler:
    """Lazily builds one backend instance per alias, shared by all threads."""

    def __init__(self) -> None:
        self._backends: dict[str, BaseBackend] = {}
        self._lock = threading.Lock()

    def __getitem__(self, alias: str) -> BaseBackend:
        backend = self._backends.get(alias)
        if backend is not None:
            return backend
        with self._lock:
            backend = self._backends.get(alias)
            if backend is None:
                backend = self.create(alias)
                self._backends[alias] = backend
            return backend

    def create(self, alias: str) -> BaseBackend:
        check_alias(alias)
        config = backend_configs()[alias]
        cls = backend_class(alias, config)
        try:
            problems = cls.validate_config(alias, config)
            if problems:
                # A backend's problems quote the settings, LOCATION and all.
                raise ImproperlyConfigured(
                    redact(f"DISTLOCKS_BACKENDS[{alias!r}] is invalid: " + "; ".join(problems))
                    + "."
                )
            return cls(alias, config)
        except Exception as exc:
            # So is a driver's error on a malformed URL, chained under the backend's.
            redact_exception(exc)
            raise

    def all(self) -> list[BaseBackend]:
        """Every configured backend (created if needed)."""
        return [self[alias] for alias in backend_configs()]

    def reset(self) -> None:
        """Forget (and close) every backend; the next access builds them anew."""
        with self._lock:
            backends, self._backends = self._backends, {}
        for backend in backends.values():
            backend.close()


backends = BackendHandler()


def reset_on_setting_change(*, setting: str, **kwargs: Any) -> None:
    if setting in ("DISTLOCKS_BACKENDS", "DISTLOCKS_KEY_PREFIX", "CACHES", "DATABASES"):
        backends.reset()
