"""Backend aliases -> backend instances, created lazily, dropped when settings change."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from distlocks.backends.base import BaseBackend
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
        raise ImproperlyConfigured(
            redact(
                f"DISTLOCKS_BACKENDS[{alias!r}]['BACKEND'] = {path!r} could not be imported: {exc}"
            )
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseBackend)):
        raise ImproperlyConfigured(
            f"DISTLOCKS_BACKENDS[{alias!r}]['BACKEND'] = {path!r} is not a subclass of "
            f"distlocks.backends.base.BaseBackend."
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
        raise ImproperlyConfigured(
            f"Unknown distlocks backend alias {alias!r}; DISTLOCKS_BACKENDS defines {known}."
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
