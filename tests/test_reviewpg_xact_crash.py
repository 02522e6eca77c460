"""PostgreSQL tokens in transaction mode across a crash (docs/safety.md, "PostgreSQL
tokens").

Transaction mode writes the token on a pooled connection of its own, committed at
once, while the caller's transaction holds the lock: the same statement as session
mode (sql.REGISTER_XACT), so the same ceiling G and marker M must carry its tokens
across a crash. As in tests/test_postgres_token_crash.py the tokens are first moved
far ahead of the clock, so that only G and M can order them; the pool commits with
synchronous_commit off, so a raise that is not made durable is lost in the crash.
"""

from __future__ import annotations

import itertools
from typing import Any

from django.db import transaction

from distlocks.backends.base import Holder
from distlocks.backends.postgres import PostgresBackend
from distlocks.backends.postgres.sql import EPOCH
from distlocks.testing.servers import PostgresServer
from tests.test_postgres_durable import (  # noqa: F401 - the fixtures
    ALIAS,
    durable,
    durable_template,
)
from tests.test_postgres_token_crash import _ahead_of_the_clock, _crash, _sql

HOLDER = Holder(host="test", pid=1, thread="main")
_owners = itertools.count()


def _xact_backend() -> PostgresBackend:
    return PostgresBackend(
        "pg_crash_xact",
        {"DATABASE": ALIAS, "OPTIONS": {"mode": "transaction", "synchronous_commit": "off"}},
    )


def _xact_cycle(backend: PostgresBackend, name: str) -> int:
    """One transaction-mode lease of ``name`` (the lock ends at COMMIT)."""
    with transaction.atomic(using=ALIAS):
        owner = f"x{next(_owners)}"
        result = backend.acquire(name, owner, 30.0, HOLDER)
        assert result.acquired
        backend.release(name, owner)
    return result.fencing_token


def test_transaction_mode_tokens_across_a_crash_ahead_of_the_clock(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    names = ["xact:crash:a", "xact:crash:b"]
    with django_db_blocker.unblock():
        backend = _xact_backend()
        try:
            ceiling = _ahead_of_the_clock(durable)
            tokens = [_xact_cycle(backend, name) for name in names for _ in range(3)]
            # The first took G + 1 and wrote M; the other name is new: M's floor.
            assert tokens[:3] == [ceiling + 1, ceiling + 2, ceiling + 3]
            assert tokens[3:] == [ceiling + 1, ceiling + 2, ceiling + 3]
        finally:
            backend.close()

        _crash(durable)
        assert _sql(durable, f"SELECT count(*) FROM {EPOCH}") == [(0,)]

        backend = _xact_backend()
        try:
            for name in [*names, "xact:crash:new"]:
                token = _xact_cycle(backend, name)
                assert token > max(tokens), f"{name}: token {token} issued again after the crash"
        finally:
            backend.close()
