"""Throwaway Redis set-ups of several servers: a Redis Cluster
(:class:`RedisClusterSet`) and a primary with replicas watched by Sentinels
(:class:`RedisSentinelSet`), each in a run directory of its own."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

from distlocks.testing.servers.process import (
    ServerError,
    _free_port,
    _RunDir,
    _Server,
    _wait_until,
)
from distlocks.testing.servers.redis_server import RedisServer, redis_server_binary


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000, fixed in Redis 6) is free too."""
    for _ in range(200):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise ServerError("found no free port whose cluster bus port (+10000) is free too")


def _redis_client(port: int) -> Any:
    """A plain redis-py client for one throwaway server (redis-py is imported lazily:
    the single-server helpers above do not need it)."""
    import redis

    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=5,
        decode_responses=True,
    )  # fmt: skip


class RedisClusterNode(RedisServer):
    """One node of a Redis Cluster; its cluster state file outlives a kill, so a restart
    on the same port rejoins the cluster as the same node."""

    name = "redis-node"

    def __init__(self, base_dir: Path, *, node_timeout_ms: int) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(
            base_dir,
            extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(base_dir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # Slots of a primary that is down must not stop the others.
                "--cluster-require-full-coverage", "no",
                # A replica may take over however long its link has been down.
                "--cluster-replica-validity-factor", "0",
            ],
        )  # fmt: skip
        self.node_id = ""

    def _pick_port(self) -> int:
        return _free_cluster_port()

    def client(self) -> Any:
        return _redis_client(self.port)


class RedisClusterSet(_RunDir):
    """A throwaway Redis Cluster on 127.0.0.1: ``masters`` primaries share the 16384 slots,
    and the first ``replicas`` primaries get one replica each.

    Formed with CLUSTER ADDSLOTS / MEET / REPLICATE (no redis-cli needed). Unlike a
    production set-up, a primary that is down does not stop the other slots
    (``cluster-require-full-coverage no``)::

        cluster = RedisClusterSet().start()
        cluster.url  # "redis+cluster://127.0.0.1:p1,127.0.0.1:p2,..."
    """

    def __init__(self, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        if masters < 1 or not 0 <= replicas <= masters:
            raise ValueError("need masters >= 1 and 0 <= replicas <= masters")
        super().__init__()
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [
            RedisClusterNode(self.base_dir / f"node-{i}", node_timeout_ms=node_timeout_ms)
            for i in range(masters + replicas)
        ]
        self._masters = masters

    def servers(self) -> list[_Server]:
        return list(self.nodes)

    def start(self) -> RedisClusterSet:
        try:
            for node in self.nodes:
                node.start()
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def _form(self) -> None:
        clients = [node.client() for node in self.nodes]
        for epoch, (node, client) in enumerate(zip(self.nodes, clients, strict=True), 1):
            node.node_id = client.execute_command("CLUSTER", "MYID")
            # Distinct epochs up front, so no epoch collision has to be resolved later.
            client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        bounds = [16384 * i // self._masters for i in range(self._masters + 1)]
        for i in range(self._masters):
            clients[i].execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        count = len(self.nodes)

        def all_known() -> bool:
            return all(
                len(c.execute_command("CLUSTER", "NODES").splitlines()) == count
                and "handshake" not in c.execute_command("CLUSTER", "NODES")
                for c in clients
            )

        _wait_until(all_known, "every cluster node knowing every other")
        for replica, master in zip(self.nodes[self._masters :], self.nodes, strict=False):
            clients[self.nodes.index(replica)].execute_command(
                "CLUSTER", "REPLICATE", master.node_id
            )
        _wait_until(self.healthy, "a healthy cluster with replicas in sync")
        for client in clients:
            client.close()

    def healthy(self) -> bool:
        """Every running node says the cluster is ok, every running replica is in sync,
        and every running node knows all the replicas as such."""
        running = [node for node in self.nodes if node.process and node.process.poll() is None]
        replicas: list[tuple[str, str]] = []
        for node in running:
            client = node.client()
            try:
                if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
                info = client.info("replication")
                if info["role"] == "slave":
                    if info.get("master_link_status") != "up":
                        return False
                    master_port = int(info["master_port"])
                    master = next(n for n in self.nodes if n.port == master_port)
                    replicas.append((node.node_id, master.node_id))
            finally:
                client.close()
        for node in running:
            client = node.client()
            try:
                table = client.execute_command("CLUSTER", "NODES")
            finally:
                client.close()
            for replica_id, master_id in replicas:
                if not any(
                    line.startswith(replica_id) and f" {master_id} " in line
                    for line in table.splitlines()
                ):
                    return False
        return True

    @property
    def url(self) -> str:
        """A LOCATION for RedisBackend naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def master_for_slot(self, slot: int) -> RedisClusterNode:
        """The node serving ``slot`` now, as the first running node that knows sees it."""
        views = self.slot_views(slot)
        if not views:
            raise ServerError(f"no running node knows who serves slot {slot}")
        return next(n for n in self.nodes if n.port == views[0])

    def slot_views(self, slot: int) -> list[int]:
        """The port of the primary each running node names as serving ``slot``, in
        node order (nodes that know of no primary for it left out). Right after a
        failover the nodes can disagree for a moment."""
        ports: list[int] = []
        for node in self.nodes:
            if not node.process or node.process.poll() is not None:
                continue
            client = node.client()
            try:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        ports.append(int(primary[1]))
                        break
            finally:
                client.close()
        return ports

    def replicas_of(self, master: RedisClusterNode) -> list[RedisClusterNode]:
        """The running replicas of ``master``, as ``master`` itself sees them."""
        client = master.client()
        try:
            info = client.info("replication")
        finally:
            client.close()
        ports = {
            int(value["port"])
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict)
        }
        return [node for node in self.nodes if node.port in ports]


class SentinelServer(_Server):
    """A redis-server in Sentinel mode watching one primary."""

    name = "sentinel"

    def start(
        self,
        *,
        service: str,
        master_port: int,
        quorum: int,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> SentinelServer:
        binary = redis_server_binary()
        for attempt in range(3):
            self.port = _free_port()
            # Sentinel rewrites its configuration file as it learns the set-up.
            config = self.base_dir / "sentinel.conf"
            config.write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.base_dir}\n"
                f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            self._spawn([str(binary), str(config), "--sentinel"], death_signal=signal.SIGKILL)
            try:
                self._wait_ready(self._ping)
                return self
            except ServerError:
                if attempt == 2:
                    raise
        return self

    def _ping(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(64).startswith(b"+PONG"):
                raise ServerError("sentinel did not answer PONG")

    def client(self) -> Any:
        return _redis_client(self.port)


class RedisSentinelSet(_RunDir):
    """A throwaway primary with ``replicas`` replicas, watched by ``sentinels`` Sentinels
    (``quorum`` of which must agree that the primary is down)::

        sentinel = RedisSentinelSet().start()
        sentinel.url  # "redis+sentinel://127.0.0.1:s1,.../distlocks/0"

    Replicas replicate as a user of their own, so a test can cut them off from the
    primary's writes (:meth:`pause_replication`), as a network partition would.
    """

    REPLICATION_USER = "replication"
    REPLICATION_PASSWORD = "distlocks-replication"

    def __init__(
        self,
        *,
        service: str = "distlocks",
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1500,
        failover_timeout_ms: int = 5000,
    ) -> None:
        super().__init__()
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        # Every server has the user, and replicates as it whenever it is a replica
        # (Sentinel turns primaries into replicas and back).
        replication = [
            "--user", self.REPLICATION_USER, "on", f">{self.REPLICATION_PASSWORD}", "~*", "+@all",
            "--masteruser", self.REPLICATION_USER, "--masterauth", self.REPLICATION_PASSWORD,
        ]  # fmt: skip
        self.redis_nodes = [RedisServer(self._dir(f"redis-{i}"), extra_args=replication)
                            for i in range(1 + replicas)]  # fmt: skip
        self.sentinels = [SentinelServer(self._dir(f"sentinel-{i}")) for i in range(sentinels)]

    def _dir(self, name: str) -> Path:
        path = self.base_dir / name
        path.mkdir()
        return path

    def servers(self) -> list[_Server]:
        return [*self.redis_nodes, *self.sentinels]

    def replica_args(self, master_port: int) -> list[str]:
        """Command-line arguments that start a server as a replica of ``master_port``."""
        return ["--replicaof", "127.0.0.1", str(master_port)]

    def start(self) -> RedisSentinelSet:
        try:
            master, *replicas = self.redis_nodes
            master.start()
            for replica in replicas:
                replica.extra_args += self.replica_args(master.port)
                replica.start()
            # Sentinels learn the replicas from the primary's INFO when they connect:
            # start them once the replicas are attached.
            _wait_until(lambda: self._in_sync(master, len(replicas)), "replicas in sync")
            for sentinel in self.sentinels:
                sentinel.start(
                    service=self.service, master_port=master.port, quorum=self.quorum,
                    down_after_ms=self.down_after_ms,
                    failover_timeout_ms=self.failover_timeout_ms,
                )  # fmt: skip
            _wait_until(self.sentinels_ready, "Sentinels knowing each other and the replicas")
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _in_sync(master: RedisServer, replicas: int) -> bool:
        client = _redis_client(master.port)
        try:
            info = client.info("replication")
        finally:
            client.close()
        online = [
            value for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict)
            and value.get("state") == "online"
        ]  # fmt: skip
        return len(online) >= replicas

    def sentinels_ready(self) -> bool:
        """Every Sentinel sees a healthy primary, all the other Sentinels, and at least
        one replica that is up and in sync: a failover can happen."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                state = client.sentinel_master(self.service)
                replicas = client.sentinel_slaves(self.service)
            finally:
                client.close()
            if (
                not state["is_master"] or state["is_sdown"] or state["is_odown"]
                or state["num-other-sentinels"] < len(self.sentinels) - 1
            ):  # fmt: skip
                return False
            if not any(
                not r["is_sdown"] and not r["is_disconnected"]
                and r.get("master-link-status") == "ok"
                for r in replicas
            ):  # fmt: skip
                return False
        return True

    @property
    def url(self) -> str:
        """A LOCATION for RedisBackend naming every Sentinel."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def current_master(self) -> RedisServer:
        """The server the Sentinels currently name as the primary."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                address = client.sentinel_get_master_addr_by_name(self.service)
            except Exception:
                continue
            finally:
                client.close()
            if address:
                return next(n for n in self.redis_nodes if n.port == int(address[1]))
        raise ServerError(f"no Sentinel names a primary for {self.service!r}")

    def pause_replication(self) -> None:
        """Cut the replicas off from the primary's writes (until :meth:`resume_replication`):
        their user is disabled and their links are dropped, so they keep retrying."""
        client = _redis_client(self.current_master().port)
        try:
            client.execute_command("ACL", "SETUSER", self.REPLICATION_USER, "off")
            client.execute_command("CLIENT", "KILL", "USER", self.REPLICATION_USER)
        finally:
            client.close()

    def resume_replication(self) -> None:
        """Let replicas of the current primary attach again."""
        for node in self.redis_nodes:
            if node.process and node.process.poll() is None:
                client = _redis_client(node.port)
                try:
                    client.execute_command("ACL", "SETUSER", self.REPLICATION_USER, "on")
                finally:
                    client.close()
