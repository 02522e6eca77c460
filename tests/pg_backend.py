"""The PostgreSQL backend the suite's tests share (one helper, not one per module)."""

from __future__ import annotations

from distlocks import get_backend
from distlocks.backends.postgres import PostgresBackend


def pg(alias: str = "pg") -> PostgresBackend:
    """The configured PostgreSQL backend ``alias`` (checked to be one)."""
    backend = get_backend(alias)
    assert isinstance(backend, PostgresBackend), f"{alias!r} is {type(backend).__name__}"
    return backend
