"""The servers this process started for tests, started once and shared: Redis and
PostgreSQL (:func:`ensure_test_servers`), Redlock's extra masters and MariaDB, each
URL exported in its environment variable so child processes reuse it."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

from distlocks.testing.servers.mariadb import MARIADB_URL_ENV, MariaDBServer
from distlocks.testing.servers.postgres import PostgresServer
from distlocks.testing.servers.process import (
    DATABASE_URL_ENV,
    REDIS_URL_ENV,
    RUN_DIR_PREFIX,
    _install_signal_cleanup,
    _sweep_stale_run_dirs,
)
from distlocks.testing.servers.redis_server import RedisServer


class ServerSet:
    """The servers one process started, cleaned up together."""

    def __init__(self) -> None:
        _sweep_stale_run_dirs()
        self.base_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        (self.base_dir / "owner.pid").write_text(str(os.getpid()))
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        self._closed = False
        atexit.register(self.close)

    def start_redis(self) -> RedisServer:
        self.redis = RedisServer(self.base_dir).start()
        return self.redis

    def start_postgres(self) -> PostgresServer:
        self.postgres = PostgresServer(self.base_dir).start()
        return self.postgres

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for server in (self.redis, self.postgres):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)


_lock = threading.Lock()
_servers: ServerSet | None = None


def ensure_test_servers(*, redis: bool = True, postgres: bool = True) -> tuple[str, str]:
    """Return ``(redis_url, database_url)``, starting throwaway servers where needed.

    Existing servers named by ``DISTLOCKS_TEST_REDIS_URL`` and
    ``DISTLOCKS_TEST_DATABASE_URL`` are used as they are. Servers started here are
    exported through those same variables, so child processes reuse them.
    """
    global _servers
    with _lock:
        redis_url = os.environ.get(REDIS_URL_ENV, "")
        database_url = os.environ.get(DATABASE_URL_ENV, "")
        if (redis and not redis_url) or (postgres and not database_url):
            if _servers is None:
                _servers = ServerSet()
                _install_signal_cleanup()
            if redis and not redis_url:
                redis_url = _servers.start_redis().url
                os.environ[REDIS_URL_ENV] = redis_url
            if postgres and not database_url:
                database_url = _servers.start_postgres().url
                os.environ[DATABASE_URL_ENV] = database_url
        return redis_url, database_url


def started_servers() -> ServerSet | None:
    """The servers this process started, if any (for fault-injection tests)."""
    return _servers


REDLOCK_URLS_ENV = "DISTLOCKS_TEST_REDLOCK_URLS"


def ensure_redlock_test_servers(count: int = 2) -> list[str]:
    """URLs of ``count`` more throwaway Redis servers, the extra masters of a Redlock
    backend in tests (the first master is the server of :func:`ensure_test_servers`).

    Servers listed (comma-separated) in ``DISTLOCKS_TEST_REDLOCK_URLS`` are used as
    they are; the ones started here are added to it, so worker processes reuse them.
    They are stopped with the other servers of this process.
    """
    global _servers
    with _lock:
        urls = [url for url in os.environ.get(REDLOCK_URLS_ENV, "").split(",") if url]
        if len(urls) < count:
            if _servers is None:
                _servers = ServerSet()
                _install_signal_cleanup()
            for index in range(len(urls), count):
                base_dir = _servers.base_dir / f"redlock-{index}"
                base_dir.mkdir(exist_ok=True)
                server = RedisServer(base_dir).start()
                # Runs before ServerSet.close (atexit is last in, first out), which
                # removes the directories.
                atexit.register(server.stop)
                urls.append(server.url)
            os.environ[REDLOCK_URLS_ENV] = ",".join(urls)
        return urls[:count]


def ensure_mariadb_test_server() -> str:
    """The URL of a MariaDB database for tests, starting a throwaway server if
    ``DISTLOCKS_TEST_MARIADB_URL`` names none (the URL is then exported, so worker
    processes reuse it). Raises ServerError, saying what to install, where MariaDB
    or a driver is missing."""
    global _servers
    with _lock:
        url = os.environ.get(MARIADB_URL_ENV, "")
        if url:
            return url
        if _servers is None:
            _servers = ServerSet()
            _install_signal_cleanup()
        server = MariaDBServer(_servers.base_dir / "mariadb").start()
        # Runs before ServerSet.close, which removes the directory.
        atexit.register(server.stop)
        os.environ[MARIADB_URL_ENV] = server.url
        return server.url
