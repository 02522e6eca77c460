"""The PostgreSQL backend's configuration: what its settings may be (the checks
behind ``validate_config`` and the system check's E004, E008 and E009), and the
connection settings of its own lock connections, derived from Django's.

No I/O: reading ``DATABASES`` and ``OPTIONS`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from distlocks.redaction import redact_exception

if TYPE_CHECKING:
    from distlocks.backends.postgres.base import PostgresBackend
    from distlocks.backends.postgres.connections import PooledBackend

MODES = ("session", "transaction")

# The system check's summary of each ID; the hint says what to change.
CHECK_TEXTS = {
    "E004": "A DISTLOCKS_BACKENDS entry is not valid for its backend class.",
    "E008": "PostgresBackend needs a PostgreSQL database.",
    "E009": "Session-mode PostgreSQL locks cannot work behind transaction pooling.",
}


def config_problems(
    backend_class: type[PostgresBackend], alias: str, config: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """The PostgreSQL-specific problems of ``config``, as (check ID, what to change)."""
    from django.conf import settings

    problems: list[tuple[str, str]] = []
    database = config.get("DATABASE", "default")
    databases = getattr(settings, "DATABASES", {})
    if database not in databases:
        problems.append(("E004", f"DATABASE {database!r} is not an alias in DATABASES"))
    elif not any(
        engine in str(databases[database].get("ENGINE", "")) for engine in ("postgresql", "postgis")
    ):
        problems.append(
            (
                "E008",
                f"DATABASE {database!r} uses {databases[database].get('ENGINE')!r}; "
                f"PostgresBackend needs 'django.db.backends.postgresql'",
            )
        )
    options = config.get("OPTIONS") or {}
    if isinstance(options, Mapping):
        mode = options.get("mode", "session")
        if mode not in MODES:
            problems.append(
                (
                    "E004",
                    f"OPTIONS['mode'] must be 'session' or 'transaction', not {mode!r}",
                )
            )
        pooler = options.get("pooler")
        if pooler not in (None, "session", "transaction"):
            problems.append(
                (
                    "E004",
                    f"OPTIONS['pooler'] must be None, 'session' or 'transaction', not {pooler!r}",
                )
            )
        if mode == "session" and pooler == "transaction":
            problems.append(
                (
                    "E009",
                    "session-mode advisory locks do not work behind a transaction-pooling "
                    "proxy (the lock stays on a server connection other clients reuse); "
                    "use OPTIONS['mode'] = 'transaction' or connect past the pooler",
                )
            )
        for key in ("socket_timeout", "connect_timeout", "pool_timeout"):
            value = options.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                problems.append(
                    (
                        "E004",
                        f"OPTIONS[{key!r}] must be a number of seconds > 0, not {value!r}",
                    )
                )
        synchronous = options.get("synchronous_commit", backend_class.DEFAULT_SYNCHRONOUS_COMMIT)
        if synchronous is not None and synchronous not in backend_class.SYNCHRONOUS_COMMIT_VALUES:
            problems.append(
                (
                    "E004",
                    f"OPTIONS['synchronous_commit'] must be None (the server's setting) or "
                    f"one of {', '.join(map(repr, backend_class.SYNCHRONOUS_COMMIT_VALUES))}, "
                    f"not {synchronous!r}",
                )
            )
        size = options.get("pool_size", backend_class.DEFAULT_POOL_SIZE)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(("E004", f"OPTIONS['pool_size'] must be an int >= 1, not {size!r}"))
    return problems


def check_messages(alias: str, problems: list[tuple[str, str]]) -> list[CheckMessage]:
    """System-check errors for (check ID, problem) pairs."""
    return [
        Error(CHECK_TEXTS[check_id], hint=f"DISTLOCKS_BACKENDS[{alias!r}]: {problem}.",
              id=f"distlocks.{check_id}")
        for check_id, problem in problems
    ]  # fmt: skip


def connect_kwargs(backend: PooledBackend) -> dict[str, Any]:
    """psycopg's connection arguments for ``backend``'s own lock connections: Django's
    for its ``DATABASE``, with the timeouts, keepalives and session settings locks need."""
    wrapper = connections[backend.database]
    try:
        params = dict(wrapper.get_connection_params())
    except ImproperlyConfigured as exc:
        # Django quotes the setting it refuses (a NAME may be a URL with a password).
        redact_exception(exc)
        raise
    # Django's own cursor classes and adapters are not needed on these connections.
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.setdefault(
        "connect_timeout",
        backend.options.get("connect_timeout", backend.DEFAULT_CONNECT_TIMEOUT),
    )
    params["application_name"] = backend.options.get("application_name", "distlocks")
    # Detect a dead peer in seconds rather than the kernel's default hours.
    params.setdefault("keepalives", 1)
    params.setdefault("keepalives_idle", 2)
    params.setdefault("keepalives_interval", 1)
    params.setdefault("keepalives_count", 2)
    params.setdefault("tcp_user_timeout", 3000)
    # A statement_timeout from DATABASES would cut lock waits short: these
    # connections bound their waits with lock_timeout instead.
    options = f"{params.get('options', '')} -c statement_timeout=0"
    # The registry write of each acquire need not wait for its WAL flush: see
    # DEFAULT_SYNCHRONOUS_COMMIT. None keeps the server's (or DATABASES') setting.
    synchronous = backend.options.get("synchronous_commit", backend.DEFAULT_SYNCHRONOUS_COMMIT)
    if synchronous is not None:
        options += f" -c synchronous_commit={synchronous}"
    params["options"] = options.strip()
    params["autocommit"] = True
    # Django turns server-side preparation off (for transaction poolers); these
    # connections are ours and session-bound, and parsing and planning the
    # acquire statement on every call costs more than the lock itself.
    params["prepare_threshold"] = 2
    return params
