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
import time
from pathlib import Path

from distlocks.testing.servers import START_TIMEOUT, ServerError, _free_port, _RunDir, _Server

#: Where Debian's ``libzookeeper-java`` puts the server jar; its manifest lists the
#: other jars it needs (netty, slf4j, ...), so the class path is this plus a logger.
ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
SLF4J_BINDING = Path("/usr/share/java/slf4j-simple.jar")
INSTALL_HINT = (
    "install it as root with `apt-get install -y --no-install-recommends "
    "libzookeeper-java default-jre-headless` (or run `make test`, which does)"
)


STANDALONE_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"
QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"


def _java(main_class: str, config: Path) -> list[str]:
    classpath = [str(ZOOKEEPER_JAR)]
    if SLF4J_BINDING.exists():
        classpath.append(str(SLF4J_BINDING))
    return [
        shutil.which("java") or "java",
        "-Xmx256m",
        "-XX:+UseSerialGC",
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
        "-cp",
        os.pathsep.join(classpath),
        main_class,
        str(config),
    ]


def _distinct_free_ports(count: int) -> list[int]:
    """``count`` different free ports. Each free port is found by binding port 0 and
    closing the socket, so two lookups may return the same port: an ensemble given
    one twice (a client port that is also a peer's election port) never forms."""
    ports: list[int] = []
    while len(ports) < count:
        port = _free_port()
        if port not in ports:
            ports.append(port)
    return ports


def mode(port: int) -> str:
    """The server's role from its ``srvr`` answer: "standalone", "leader" or
    "follower" once it serves requests; "" while it does not."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(b"srvr")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return ""


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
                        "4lw.commands.whitelist=srvr,ruok,mntr,cons",
                        f"forceSync={'yes' if self.durable else 'no'}",
                        "",
                    ]
                )
            )
            self._spawn(_java(STANDALONE_MAIN, config), death_signal=signal.SIGKILL)
            try:
                self._wait_ready(self._probe)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
        return self

    def _probe(self) -> None:
        if mode(self.port) != "standalone":
            raise ServerError("zookeeper is not serving yet")

    @property
    def location(self) -> str:
        """The connection string for ``LOCATION``."""
        return f"127.0.0.1:{self.port}"


class ZooKeeperNode(_Server):
    """One server of a :class:`ZooKeeperEnsemble` (its data survives a kill)."""

    name = "zookeeper-node"

    def __init__(self, base_dir: Path, myid: int, port: int) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(base_dir)
        self.myid = myid
        self.port = port
        self.config = base_dir / "zoo.cfg"

    def start(self) -> ZooKeeperNode:
        """Start (or restart, rejoining the ensemble); does not wait for a quorum."""
        self._spawn(_java(QUORUM_MAIN, self.config), death_signal=signal.SIGKILL)
        return self

    @property
    def mode(self) -> str:
        try:
            return mode(self.port)
        except OSError:
            return ""


class ZooKeeperEnsemble(_RunDir):
    """``size`` ZooKeeper servers forming one ensemble on loopback, for fault tests::

    ensemble = ZooKeeperEnsemble().start()   # ensemble.location: "127.0.0.1:P1,..."
    ensemble.leader().kill()
    """

    def __init__(self, size: int = 3, *, tick_ms: int = 250) -> None:
        super().__init__()
        self.tick_ms = tick_ms
        # A client, a quorum and an election port per server, all different.
        ports = iter(_distinct_free_ports(3 * size))
        self.nodes = [
            ZooKeeperNode(self.base_dir / f"node{myid}", myid, next(ports))
            for myid in range(1, size + 1)
        ]
        peers = [f"server.{node.myid}=127.0.0.1:{next(ports)}:{next(ports)}" for node in self.nodes]
        for node in self.nodes:
            data_dir = node.base_dir / "data"
            data_dir.mkdir(exist_ok=True)
            (data_dir / "myid").write_text(f"{node.myid}\n")
            node.config.write_text(
                "\n".join(
                    [
                        f"tickTime={tick_ms}",
                        "initLimit=40",
                        "syncLimit=8",
                        f"dataDir={data_dir}",
                        f"clientPort={node.port}",
                        "clientPortAddress=127.0.0.1",
                        f"minSessionTimeout={4 * tick_ms}",
                        "maxSessionTimeout=60000",
                        "admin.enableServer=false",
                        "4lw.commands.whitelist=srvr,ruok,mntr,cons",
                        "forceSync=no",
                        *peers,
                        "",
                    ]
                )
            )

    def servers(self) -> list[_Server]:
        return list(self.nodes)

    def start(self) -> ZooKeeperEnsemble:
        missing = zookeeper_missing()
        if missing:
            raise ServerError(f"Cannot start ZooKeeper: {missing}.")
        for node in self.nodes:
            node.start()
        self.wait_for_quorum()
        return self

    def wait_for_quorum(self, timeout: float = START_TIMEOUT) -> ZooKeeperNode:
        """Wait until one node leads and every running node serves; the leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = [n for n in self.nodes if n.process and n.process.poll() is None]
            modes = {node.myid: node.mode for node in running}
            leaders = [n for n in running if modes[n.myid] == "leader"]
            if len(leaders) == 1 and all(modes.values()):
                return leaders[0]
            time.sleep(0.05)
        logs = "\n".join(f"node {n.myid}:\n{n.log_tail(10)}" for n in self.nodes)
        raise ServerError(f"the ZooKeeper ensemble formed no quorum in {timeout:.0f}s:\n{logs}")

    def leader(self) -> ZooKeeperNode:
        return next(node for node in self.nodes if node.mode == "leader")

    @property
    def location(self) -> str:
        return ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
