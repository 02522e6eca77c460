"""A throwaway standalone ZooKeeper server for tests, benchmarks and the demo.

No ZooKeeper ships in a wheel, so this runs Debian's jars (``libzookeeper-java``) with
a headless JRE (``default-jre-headless``), installed as root with::

    apt-get install -y --no-install-recommends libzookeeper-java default-jre-headless

The server is started directly (``java -cp ... ZooKeeperServerMain zoo.cfg``, no
systemd) in a run directory of its own on a free loopback port, with the same clean-up
as the Redis and PostgreSQL servers of :mod:`distlocks.testing.servers`::

    server = ZooKeeperServer().start()   # server.location: "127.0.0.1:PORT"
    ...
    server.close()

:func:`zookeeper_missing` says what to install when the server cannot run here (tests
skip with that message).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

from distlocks.testing.servers import ServerError, _free_port, _RunDir, _Server

#: Where Debian's ``libzookeeper-java`` puts the server jar; its manifest lists the
#: other jars it needs (netty, slf4j, ...), so the class path is this plus a logger.
ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
SLF4J_BINDING = Path("/usr/share/java/slf4j-simple.jar")
INSTALL_HINT = (
    "install it as root with `apt-get install -y --no-install-recommends "
    "libzookeeper-java default-jre-headless` (or run `make test`, which does)"
)


def zookeeper_missing() -> str:
    """Why a ZooKeeper server cannot be started here ("" when it can)."""
    if shutil.which("java") is None:
        return f"no `java` executable on PATH: {INSTALL_HINT}"
    if not ZOOKEEPER_JAR.exists():
        return f"ZooKeeper's jar {ZOOKEEPER_JAR} is missing: {INSTALL_HINT}"
    return ""


class ZooKeeperServer(_Server, _RunDir):
    """A standalone ZooKeeper on 127.0.0.1, data in its run directory.

    ``tick_ms`` sets ZooKeeper's tick; sessions may ask for 4 ticks up to 60 s (the
    default 250 ms tick lets tests use 1 s sessions, so an expiry takes about 1 s).
    With ``durable`` the transaction log is synced to disk before each reply, as in
    production (for benchmarks); by default it is not, as tests may.
    """

    name = "zookeeper"

    def __init__(
        self, *, tick_ms: int = 250, max_session_ms: int = 60_000, durable: bool = False
    ) -> None:
        _RunDir.__init__(self)
        _Server.__init__(self, self.base_dir)
        self.tick_ms = tick_ms
        self.max_session_ms = max_session_ms
        self.durable = durable

    def servers(self) -> list[_Server]:
        return [self]

    def start(self, port: int | None = None) -> ZooKeeperServer:
        """Start (or, after :meth:`stop`/:meth:`kill`, restart with its data) on ``port``
        or a free port."""
        missing = zookeeper_missing()
        if missing:
            raise ServerError(f"Cannot start ZooKeeper: {missing}.")
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            data_dir = self.base_dir / "data"
            data_dir.mkdir(exist_ok=True)
            config = self.base_dir / "zoo.cfg"
            config.write_text(
                "\n".join(
                    [
                        f"tickTime={self.tick_ms}",
                        f"dataDir={data_dir}",
                        f"clientPort={self.port}",
                        "clientPortAddress=127.0.0.1",
                        f"minSessionTimeout={4 * self.tick_ms}",
                        f"maxSessionTimeout={self.max_session_ms}",
                        # No HTTP admin server (it would take port 8080).
                        "admin.enableServer=false",
                        "4lw.commands.whitelist=srvr,ruok,mntr",
                        f"forceSync={'yes' if self.durable else 'no'}",
                        "",
                    ]
                )
            )
            classpath = [str(ZOOKEEPER_JAR)]
            if SLF4J_BINDING.exists():
                classpath.append(str(SLF4J_BINDING))
            self._spawn(
                [
                    shutil.which("java") or "java",
                    "-Xmx256m",
                    "-XX:+UseSerialGC",
                    "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                    "-cp",
                    os.pathsep.join(classpath),
                    "org.apache.zookeeper.server.ZooKeeperServerMain",
                    str(config),
                ],
                death_signal=signal.SIGKILL,
            )
            try:
                self._wait_ready(self._probe)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
        return self

    def _probe(self) -> None:
        # "srvr" answers "Mode: standalone" only once the server serves requests.
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"srvr")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        if b"Mode: standalone" not in reply:
            raise ServerError(f"zookeeper is not serving yet: {reply[:80]!r}")

    @property
    def location(self) -> str:
        """The connection string for ``LOCATION``."""
        return f"127.0.0.1:{self.port}"
