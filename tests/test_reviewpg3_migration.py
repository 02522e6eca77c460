"""Review of migration 0004 (the mint as the function ``distlocks_mint`` and the
registry's hidden ``ceiling`` column), by attack: taken back to 0003 and forward
again under live rows and a held lock, and the code run against a database that
is behind it, in both modes; then the server restarted and crashed under the same
backend. One server of its own (the ``durable`` fixture), for
the whole file's single test."""

from __future__ import annotations

import itertools
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import transaction

from distlocks.backends.base import Holder
from distlocks.backends.postgres import TABLE, PostgresBackend
from distlocks.exceptions import LockError
from distlocks.testing.servers import PostgresServer
from tests.test_postgres_durable import (  # noqa: F401 - the fixtures
    ALIAS,
    durable,
    durable_template,
)
from tests.test_postgres_token_crash import _crash, _restart

HOLDER = Holder(host="h", pid=1, thread="t")
_owners = itertools.count()


def _session() -> PostgresBackend:
    return PostgresBackend("reviewpg3_mig", {"DATABASE": ALIAS})


def _xact() -> PostgresBackend:
    return PostgresBackend(
        "reviewpg3_mig_xact", {"DATABASE": ALIAS, "OPTIONS": {"mode": "transaction"}}
    )


def _cycle(backend: PostgresBackend, name: str) -> int:
    owner = f"o{next(_owners)}"
    result = backend.acquire(name, owner, 30.0, HOLDER)
    assert result.acquired
    assert backend.release(name, owner)
    return result.fencing_token


def _free(server: PostgresServer, backend: PostgresBackend, name: str) -> bool:
    with psycopg.connect(server.url, autocommit=True) as other:
        # Unlocked before the connection closes: the server ends a closed session
        # (and frees its locks) only some time after the client has gone.
        row = other.execute(
            "SELECT pg_try_advisory_lock(%(key)s) AND pg_advisory_unlock(%(key)s)",
            {"key": backend.key(name)},
        ).fetchone()
        return bool(row and row[0])


def test_0004_back_to_0003_and_forward_under_live_rows(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    names = ["mig:a", "mig:b", "mig:c"]
    with django_db_blocker.unblock():
        backend, xact = _session(), _xact()
        try:
            issued = {n: [_cycle(backend, n) for _ in range(3)] for n in names}
            held = "o-held"
            assert backend.acquire("mig:held", held, 30.0, HOLDER).acquired
            issued["mig:held"] = [backend._held[held].token]

            call_command("migrate", "distlocks", "0003", database=ALIAS, verbosity=0)
            # The held lock is untouched (its renewal reads no table of ours)...
            assert backend.extend("mig:held", held, 30.0)
            # ...and every new lock is refused, saying to migrate, with nothing left
            # held: the code needs 0004.
            for name in names:
                with pytest.raises(LockError, match=r"manage\.py migrate distlocks"):
                    backend.acquire(name, "o-refused", 30.0, HOLDER)
                assert _free(durable, backend, name)
                with transaction.atomic(using=ALIAS):
                    with pytest.raises(LockError, match=r"manage\.py migrate distlocks"):
                        xact.acquire(name, "o-refused-x", 30.0, HOLDER)
                    # Not held by the caller's transaction either, though it goes on.
                    assert _free(durable, backend, name)
            assert backend.held_connection_count() == 1

            call_command("migrate", "distlocks", database=ALIAS, verbosity=0)
            assert backend.extend("mig:held", held, 30.0)
            assert backend.release("mig:held", held)
            for name, tokens in issued.items():
                for mint in (backend, xact, backend):
                    if mint is xact:
                        with transaction.atomic(using=ALIAS):
                            owner = f"x{next(_owners)}"
                            result = xact.acquire(name, owner, 30.0, HOLDER)
                            assert result.acquired
                            token = result.fencing_token
                    else:
                        token = _cycle(mint, name)
                    assert token > max(tokens), f"{name}: {token} after {tokens}"
                    tokens.append(token)
            # Every row went through the slow mint again (its ceiling was dropped).
            with psycopg.connect(durable.url, autocommit=True) as check:
                rows = check.execute(
                    f"SELECT count(*) FROM {TABLE} WHERE ceiling < fencing_token"
                ).fetchone()
            assert rows == (0,)

            # The server restarted (cleanly, then crashed) under the same backend: its
            # idle connections, whose prepared statements went with their sessions, are
            # replaced before use, and a held lease learns that its lock is gone.
            for restart in (_restart, _crash):
                kept = f"o-kept-{restart.__name__}"
                assert backend.acquire("mig:held", kept, 30.0, HOLDER).acquired
                assert _cycle(backend, "mig:a") > 0  # an idle connection, prepared
                restart(durable)
                assert backend.extend("mig:held", kept, 30.0) is False
                for name, tokens in issued.items():
                    token = _cycle(backend, name)
                    assert token > max(tokens), f"{name}: {token} after {tokens}"
                    tokens.append(token)
        finally:
            backend.close()
            xact.close()
