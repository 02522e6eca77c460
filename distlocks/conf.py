"""distlocks settings, read from ``django.conf.settings`` on every access.

Nothing is copied at import time, so ``override_settings`` works everywhere.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    "DISTLOCKS_DEFAULT_TTL": 30.0,
    "DISTLOCKS_DEFAULT_TIMEOUT": 10.0,
    "DISTLOCKS_KEY_PREFIX": "distlocks",
    "DISTLOCKS_STUCK_AFTER": 3600.0,
    "DISTLOCKS_METRICS": False,
    "DISTLOCKS_RELEASE_ON_COMMIT": True,
}


class Settings:
    """One typed property per setting."""

    @property
    def BACKENDS(self) -> Any:  # validated by checks and the handler
        return getattr(settings, "DISTLOCKS_BACKENDS", None)

    @property
    def DEFAULT_TTL(self) -> float:
        """Lease length in seconds when ``lock()`` is given no ``ttl``."""
        return getattr(settings, "DISTLOCKS_DEFAULT_TTL", DEFAULTS["DISTLOCKS_DEFAULT_TTL"])

    @property
    def DEFAULT_TIMEOUT(self) -> float | None:
        """Seconds to wait for a busy lock when ``lock()`` is given no ``timeout``."""
        return getattr(settings, "DISTLOCKS_DEFAULT_TIMEOUT", DEFAULTS["DISTLOCKS_DEFAULT_TIMEOUT"])

    @property
    def KEY_PREFIX(self) -> str:
        """Prefix of every key or name distlocks writes on a server."""
        return getattr(settings, "DISTLOCKS_KEY_PREFIX", DEFAULTS["DISTLOCKS_KEY_PREFIX"])

    @property
    def STUCK_AFTER(self) -> float:
        """Seconds a lock may be held before the admin page and metrics call it stuck."""
        return getattr(settings, "DISTLOCKS_STUCK_AFTER", DEFAULTS["DISTLOCKS_STUCK_AFTER"])

    @property
    def METRICS(self) -> bool:
        """Export Prometheus metrics (connected once, in ``AppConfig.ready()``)."""
        return getattr(settings, "DISTLOCKS_METRICS", DEFAULTS["DISTLOCKS_METRICS"])

    @property
    def RELEASE_ON_COMMIT(self) -> bool:
        """A lock released inside ``transaction.atomic()`` is freed when the transaction
        commits or rolls back (``lock(release_on_commit=...)`` overrides it per lock)."""
        return getattr(
            settings, "DISTLOCKS_RELEASE_ON_COMMIT", DEFAULTS["DISTLOCKS_RELEASE_ON_COMMIT"]
        )


conf = Settings()
