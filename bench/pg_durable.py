"""PostgreSQL on a server with production settings: the ``pg-cycle-durable`` workload.

The benchmark's PostgreSQL (:mod:`distlocks.testing.servers`) runs with ``fsync=off``,
``synchronous_commit=off`` and ``full_page_writes=off``: fast, and fine for tests, but a
commit there never waits for the disk. Every distlocks acquire commits a registry write
(the fencing counter and the holder), so on such a server the cost production pays for
that write is not counted. This module starts a second, *durable* PostgreSQL for the run
(``PostgresServer(durable=True)``: the server's defaults, ``fsync=on``,
``synchronous_commit=on``, ``full_page_writes=on``) in a directory of its own, creates and
migrates the benchmark's database in it, and measures the uncontended cycle on both
servers in one workload:

* on the fast server: ``pg-floor``, ``distlocks-pg``, ``django-pglock`` (as in ``cycle``);
* on the durable server: ``durable-pg-floor`` (the raw advisory lock + unlock pair, which
  writes nothing and so never waits for a flush), ``durable-distlocks-pg`` (the default,
  lock connections with ``synchronous_commit=off``), ``durable-distlocks-pg-sync``
  (``OPTIONS["synchronous_commit"] = "on"``: every acquire waits for its WAL flush) and
  ``durable-django-pglock``; and ``durable-distlocks-pg-backend``
  (``PostgresBackend.acquire`` / ``release`` directly, default settings), which splits
  the default row into the backend (statements, pool) and the ``Lock``/``Lease`` layer.

Each row is compared with the floor of its own server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.base import (
    DURABLE_DATABASE_ENV,
    Env,
    Implementation,
    implementation,
    workload,
)
from bench.postgres import DistlocksPg, DistlocksPgBackend, DjangoPglock, PgFloor
from bench.workloads import Cycle

NAME = "pg-cycle-durable"
#: The family of the rows on the durable server (compared with ``durable-pg-floor``).
FAMILY = "postgres-durable"
#: Django's alias of the durable server's database (see :mod:`bench.settings`).
DATABASE_ALIAS = "durable"
SERVERS = frozenset({"postgres", "postgres-durable"})


def missing() -> str:
    """Why the durable server cannot be started here ("" when it can)."""
    from distlocks.testing.servers import ServerError, postgres_bin_dir

    try:
        postgres_bin_dir()
    except ServerError as exc:
        return str(exc)
    return ""


class DurableServer:
    """A PostgreSQL with production settings, in a directory removed on :meth:`close`."""

    def __init__(self) -> None:
        from distlocks.testing.servers import RUN_DIR_PREFIX, PostgresServer

        # Named like the throwaway servers' directories, so a crashed run's is swept too.
        self.base_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}durable-"))
        (self.base_dir / "owner.pid").write_text(str(os.getpid()))
        self.server = PostgresServer(self.base_dir, durable=True)

    def start(self) -> DurableServer:
        try:
            self.server.start()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def location(self) -> str:
        return self.server.url

    def close(self) -> None:
        try:
            self.server.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)


def start_server() -> DurableServer:
    return DurableServer().start()


def durable_env() -> Env:
    """An :class:`Env` whose PostgreSQL is the durable server (for bench.postgres' helpers)."""
    return Env(database_url=os.environ.get(DURABLE_DATABASE_ENV, ""))


def server_settings() -> dict[str, str]:
    """The durability settings the durable server runs with, read back from it."""
    import psycopg

    url = os.environ.get(DURABLE_DATABASE_ENV, "")
    if not url:
        return {}
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return {
            name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
            for name in ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method")
        }


@implementation
class DurablePgFloor(PgFloor):
    """psycopg ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` on the durable server."""

    name = "durable-pg-floor"
    label = "raw pg_try_advisory_lock + pg_advisory_unlock (durable server)"
    family = FAMILY
    servers = SERVERS
    workloads = frozenset({NAME})

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        from bench.postgres import bench_conninfo

        self._conninfo = bench_conninfo(durable_env())


@implementation
class DurableDistlocksPg(DistlocksPg):
    """distlocks ``lock(backend="pg-durable")``: lock connections with synchronous_commit=off
    (the default), on the durable server."""

    name = "durable-distlocks-pg"
    label = 'distlocks lock(backend="pg-durable"), synchronous_commit=off (default)'
    family = FAMILY
    servers = SERVERS
    workloads = frozenset({NAME})
    alias = "pg-durable"


@implementation
class DurableDistlocksPgSync(DistlocksPg):
    """distlocks with ``OPTIONS["synchronous_commit"] = "on"``, on the durable server:
    every acquire waits for the WAL flush of its registry write."""

    name = "durable-distlocks-pg-sync"
    label = 'distlocks lock(backend="pg-durable-sync"), synchronous_commit=on'
    family = FAMILY
    servers = SERVERS
    workloads = frozenset({NAME})
    reference = False
    alias = "pg-durable-sync"


@implementation
class DurableDistlocksPgBackend(DistlocksPgBackend):
    """distlocks one layer down on the durable server: ``PostgresBackend.acquire`` /
    ``release`` (default settings), without ``Lock``, ``Lease``, renewal or signals."""

    name = "durable-distlocks-pg-backend"
    label = "distlocks PostgresBackend.acquire/release (durable server)"
    family = FAMILY
    servers = SERVERS
    workloads = frozenset({NAME})
    backend_alias = "pg-durable"


@implementation
class DurableDjangoPglock(DjangoPglock):
    """django-pglock's ``advisory()`` on Django's connection to the durable server."""

    name = "durable-django-pglock"
    label = "django-pglock advisory() (durable server)"
    family = FAMILY
    servers = SERVERS
    workloads = frozenset({NAME})

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        import functools

        import pglock

        self._advisory = functools.partial(pglock.advisory, using=DATABASE_ALIAS)

    def thread_start(self) -> None:
        from django.db import connections

        connections[DATABASE_ALIAS].ensure_connection()


@workload
class DurableCycle(Cycle):
    """The uncontended cycle on the fast and on the durable PostgreSQL, in one workload."""

    name = NAME
    title = "PostgreSQL cycle on the fast server and on a durable one (fsync=on)"
    description = (
        "The uncontended acquire + release cycle of 'cycle', on the benchmark's fast "
        "PostgreSQL (fsync=off, synchronous_commit=off) and on a second one the run "
        "starts with production settings (fsync=on, synchronous_commit=on, "
        "full_page_writes=on); each row is compared with the raw advisory-lock floor "
        "of its own server. distlocks runs there twice: with its default "
        "synchronous_commit=off on lock connections, and with 'on'."
    )

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        if impl.family not in ("postgres", FAMILY):
            return False
        return impl.workloads is None or cls.name in impl.workloads

    def params(self) -> dict[str, Any]:
        return {**super().params(), "durable_server": server_settings()}
