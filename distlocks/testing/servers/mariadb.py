"""A throwaway MariaDB server (Debian's ``mariadb-server``), for the MySQL/MariaDB
fencing tests, and the Django ``DATABASES`` entry of a ``mysql://`` URL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distlocks.testing.servers.process import ServerError, _free_port, _Server

MARIADB_URL_ENV = "DISTLOCKS_TEST_MARIADB_URL"
# Non-root user that runs mariadbd when we are root, as for PostgreSQL.
MARIADB_SYSTEM_USER = "distlocks_mariadb"
MARIADB_INSTALL_HINT = (
    "Install Debian's mariadb-server (as root: apt-get install mariadb-server; `make test` "
    f"does it) and PyMySQL (the dev extra), or set {MARIADB_URL_ENV} to a server's "
    "mysql://user:password@host:port/database URL."
)


def mariadb_binaries() -> tuple[Path, Path]:
    """Paths of ``mariadbd`` and ``mariadb-install-db`` (or their mysql names)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])
    server = shutil.which("mariadbd", path=search) or shutil.which("mysqld", path=search)
    install = shutil.which("mariadb-install-db", path=search) or shutil.which(
        "mysql_install_db", path=search
    )
    if not server or not install:
        raise ServerError(f"MariaDB is not installed. {MARIADB_INSTALL_HINT}")
    return Path(server), Path(install)


def _mysql_driver() -> Any:
    """PyMySQL, or mysqlclient's MySQLdb."""
    try:
        import pymysql

        return pymysql
    except ImportError:
        try:
            import MySQLdb

            return MySQLdb
        except ImportError:
            raise ServerError(f"No MySQL driver is installed. {MARIADB_INSTALL_HINT}") from None


def mariadb_database_settings(url: str) -> dict[str, Any]:
    """A Django ``DATABASES`` entry for a ``mysql://user:password@host:port/name`` URL."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": unquote(parts.path.lstrip("/")) or "distlocks",
        "USER": unquote(parts.username or "root"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": parts.port or 3306,
        "OPTIONS": {"charset": "utf8mb4"},
    }


class MariaDBServer(_Server):
    """A MariaDB server from Debian's ``mariadb-server``: a data directory made with
    ``mariadb-install-db``, ``root`` without a password on 127.0.0.1 and on a socket in
    the directory, a database named ``distlocks``. Run as an unprivileged user when we
    are root. ``log_bin=True`` turns binary logging on (where creating a trigger needs
    SUPER or ``log_bin_trust_function_creators``)."""

    name = "mariadb"
    DATABASE = "distlocks"

    def __init__(self, base_dir: Path, *, log_bin: bool = False) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(base_dir)
        self.data_dir = base_dir / "data"
        self.socket_path = base_dir / "mariadb.sock"
        self.user: str | None = None
        self.log_bin = log_bin

    def _prepare_root(self) -> None:
        # As root, the server runs as root (it refuses to unless told so by --user).
        # Not as a system user of its own: that user had to traverse the temporary
        # directories, made 0700 again whenever another pytest session starts (pytest
        # resets its root's mode), and the server then failed to write its files.
        self.user = "root"

    def start(self, port: int | None = None) -> MariaDBServer:
        server, install = mariadb_binaries()
        _mysql_driver()
        if os.geteuid() == 0:
            self._prepare_root()
        self.data_dir.mkdir(exist_ok=True)
        if not (self.data_dir / "mysql").exists():
            result = subprocess.run(
                [str(install), "--no-defaults", f"--datadir={self.data_dir}",
                 "--auth-root-authentication-method=normal", "--skip-test-db",
                 "--skip-name-resolve",
                 *([f"--user={self.user}"] if self.user else [])],
                capture_output=True, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise ServerError(
                    f"mariadb-install-db failed ({result.returncode}): "
                    f"{(result.stderr or result.stdout).decode(errors='replace')[-2000:]}"
                )
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            self._spawn(
                [
                    str(server), "--no-defaults",
                    f"--datadir={self.data_dir}",
                    f"--port={self.port}", "--bind-address=127.0.0.1",
                    f"--socket={self.socket_path}",
                    f"--pid-file={self.base_dir / 'mariadb.pid'}",
                    "--skip-name-resolve",
                    *([f"--user={self.user}"] if self.user else []),
                    "--character-set-server=utf8mb4",
                    "--collation-server=utf8mb4_unicode_ci",
                    "--max-connections=300",
                    # A test server trades durability for speed.
                    "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
                    "--innodb-buffer-pool-size=32M",
                    *([f"--log-bin={self.data_dir / 'binlog'}", "--server-id=1"]
                      if self.log_bin else []),
                ],
                user=self.user,
                death_signal=signal.SIGTERM,
            )  # fmt: skip
            try:
                self._wait_ready(self._probe)
                break
            except ServerError:
                if attempt == attempts - 1:
                    raise
        self.execute(
            f"CREATE DATABASE IF NOT EXISTS `{self.DATABASE}` CHARACTER SET utf8mb4"
            " COLLATE utf8mb4_unicode_ci"
        )
        return self

    def connect(self, user: str = "root", password: str = "", database: str | None = None) -> Any:
        """A driver connection (autocommit) over TCP."""
        driver = _mysql_driver()
        kwargs: dict[str, Any] = {"database": database} if database else {}
        conn = driver.connect(
            host="127.0.0.1", port=self.port, user=user, password=password,
            connect_timeout=5, autocommit=True, **kwargs,
        )  # fmt: skip
        return conn

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement as root; the rows it returned."""
        conn = self.connect()
        try:
            cursor = conn.cursor()
            cursor.execute(sql, params)
            return list(cursor.fetchall() or ())
        finally:
            conn.close()

    def _probe(self) -> None:
        self.connect().close()

    def url_for(self, database: str, user: str = "root", password: str = "") -> str:
        from urllib.parse import quote

        auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
        return f"mysql://{auth}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for(self.DATABASE)
