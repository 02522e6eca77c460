"""PostgreSQL tokens across a server crash, on a server with production settings.

The registry (the fencing counter) is UNLOGGED, and distlocks' lock connections commit
with ``synchronous_commit=off``: a crash of the server loses the counter. Tokens must
still go on increasing, from the key's durable ceiling (and the server clock; the
tests that take the clock out are in test_postgres_token_crash.py). This starts its
own PostgreSQL (``PostgresServer(durable=True)``: ``fsync=on``, ``full_page_writes=on``),
crashes it with an immediate shutdown (SIGQUIT to the postmaster: no checkpoint, WAL
not yet written is lost, crash recovery at the next start) and checks both that the
counter really was lost and that the next token is above every token issued before
the crash.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connections

from distlocks.backends.base import Holder
from distlocks.backends.postgres import TABLE, PostgresBackend
from distlocks.testing.servers import RUN_DIR_PREFIX, PostgresServer, ServerError

ALIAS = "pg_crash"


def _settings(server: PostgresServer) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "postgres",
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": server.port,
    }


@pytest.fixture(scope="module")
def durable_template(django_db_blocker: Any) -> Iterator[Path]:
    """The data directory of a migrated PostgreSQL with production settings, shut down
    cleanly: each test's server starts from a copy of it (initdb, start and migrate
    took 3-5 s a test). Made once by each module that imports ``durable``."""
    base = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}crash-template-"))
    (base / "owner.pid").write_text(str(os.getpid()))
    server = PostgresServer(base, durable=True)
    try:
        try:
            server.start()
        except ServerError as exc:
            pytest.skip(str(exc))
        # The WAL writer flushes asynchronous commits at its own pace (at most 10 s
        # here): the updates made just before a crash are then surely not on disk yet.
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        with _alias(server), django_db_blocker.unblock():
            call_command("migrate", "distlocks", database=ALIAS, verbosity=0)
        server.stop()
        yield server.data_dir
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def _alias(server: PostgresServer) -> Iterator[None]:
    """The ``pg_crash`` database alias, on ``server``, for the duration."""
    configured = connections.configure_settings({"default": {}, ALIAS: _settings(server)})
    connections.settings[ALIAS] = configured[ALIAS]
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            connections[ALIAS].close()
        del connections[ALIAS]
        del connections.settings[ALIAS]


@pytest.fixture
def durable(durable_template: Path) -> Iterator[PostgresServer]:
    """A migrated PostgreSQL with production settings, as the ``pg_crash`` alias: a
    server of the test's own, started on a copy of the template's data."""
    base = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}crash-"))
    (base / "owner.pid").write_text(str(os.getpid()))
    server = PostgresServer(base, durable=True)
    try:
        # cp -a keeps the owner and modes PostgreSQL insists on (its own user, 0700).
        subprocess.run(["cp", "-a", str(durable_template), str(server.data_dir)], check=True)
        server.start()
        with _alias(server):
            yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def _stored_counter(server: PostgresServer, key: int) -> int | None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        row = conn.execute(f"SELECT fencing_token FROM {TABLE} WHERE key = %s", (key,)).fetchone()
    return None if row is None else int(row[0])


def test_tokens_keep_increasing_across_a_crash_that_lost_counter_updates(
    durable: PostgresServer, django_db_blocker: Any
) -> None:
    holder = Holder(host="test", pid=1, thread="main")
    name = "crash:tokens"
    with django_db_blocker.unblock():
        backend = PostgresBackend("pg_crash", {"DATABASE": ALIAS})
        try:
            first = backend.acquire(name, "owner-0", 30.0, holder)
            assert first.acquired
            assert backend.release(name, "owner-0")
            key = backend.key(name)
            # The row, with the first token, is on disk; what follows is not yet.
            with psycopg.connect(durable.url, autocommit=True) as conn:
                conn.execute("CHECKPOINT")
            tokens = [first.fencing_token]
            for i in range(1, 6):
                result = backend.acquire(name, f"owner-{i}", 30.0, holder)
                assert result.acquired
                tokens.append(result.fencing_token)
                assert backend.release(name, f"owner-{i}")
            # A held lock too: the crash ends its session, and it must be free after.
            held = backend.acquire(name, "owner-held", 30.0, holder)
            assert held.acquired
            tokens.append(held.fencing_token)
            assert tokens == sorted(set(tokens))
        finally:
            backend.close()

        # Immediate shutdown: a crash, as far as the data is concerned.
        assert durable.process is not None
        durable.process.send_signal(signal.SIGQUIT)
        durable.process.wait(30)
        durable.start(port=durable.port)

        # The counter is gone: the crash truncated the unlogged registry...
        assert _stored_counter(durable, key) is None
        backend = PostgresBackend("pg_crash", {"DATABASE": ALIAS})
        try:
            after = backend.acquire(name, "owner-after", 30.0, holder)
            assert after.acquired, "the crash ended the holder's session and its lock"
            # ...and the next token is still above every token issued before the crash.
            assert after.fencing_token > max(tokens)
            assert backend.release(name, "owner-after")
        finally:
            backend.close()
