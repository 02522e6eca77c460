"""RedisBackend on a real Redis Cluster: one slot per lock, every primary listed,
one round trip per operation, and a primary lost and replaced by its replica.

The cluster (three primaries, one of them with a replica) is started once per test
session, on first use. The contract tests imported below run here again, on the
cluster alias (their ``alias`` fixtures are overridden in this module).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.test import override_settings
from redis.cluster import RedisCluster, key_slot

from distlocks import alock, lock
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable, LockError, LockNotAcquired
from distlocks.locks import current_holder
from distlocks.testing import servers
from distlocks.testing.servers import RedisClusterNode, RedisClusterSet, RedisServer
from tests.redis_contract import *  # noqa: F403 - the contract tests, on this alias
from tests.redis_contract import BACKEND, redis_alias, redis_backend
from tests.test_redis import SCRIPT_INNER
from tests.waiting import process_alive, wait_for, wait_gone


@pytest.fixture
def topology_alias(redis_cluster: RedisClusterSet) -> Iterator[str]:
    with redis_alias("cluster", redis_cluster.url) as alias:
        yield alias


cluster_backend = redis_backend


def name_on(
    cluster: RedisClusterSet, backend: RedisBackend, node: RedisClusterNode, base: str
) -> str:
    """A lock name whose keys live in a slot that ``node`` serves."""
    for i in range(10_000):
        candidate = f"{base}:{i}"
        slot = key_slot(backend.all_keys(candidate).lock.encode())
        if cluster.master_for_slot(slot) is node:
            return candidate
    raise AssertionError(f"no name found for node {node.port}")


def primaries(cluster: RedisClusterSet) -> list[RedisClusterNode]:
    ports = set()
    for node in cluster.nodes:
        if node.process and node.process.poll() is None:
            client = node.client()
            try:
                ports |= {int(entry[2][1]) for entry in client.execute_command("CLUSTER", "SLOTS")}
            finally:
                client.close()
            break
    return [node for node in cluster.nodes if node.port in ports]


# -- configuration ----------------------------------------------------------------


def test_cluster_location_builds_a_cluster_client(topology_alias: str) -> None:
    backend = cluster_backend(topology_alias)
    assert backend.mode == "cluster"
    assert isinstance(backend.client, RedisCluster)
    # Our timeouts reach the node connections.
    kwargs = backend.client.nodes_manager.connection_kwargs
    assert kwargs["socket_timeout"] == RedisBackend.DEFAULT_SOCKET_TIMEOUT
    assert backend.wait_chunk == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("redis+cluster://", "names no host"),
        ("redis+cluster://127.0.0.1:7000/2", "database 0 only"),
        ("redis+cluster://127.0.0.1:7000,,127.0.0.1:7001", "a node that is not host:port"),
        ("redis+cluster://127.0.0.1:99999", "a node that is not host:port"),
        ("redis+cluster://127.0.0.1:7000?socket_timeout=soon", "socket_timeout"),
        ("cluster://127.0.0.1:7000", "must start with redis://, rediss:// or unix://"),
    ],
)
def test_bad_cluster_locations_fail_the_checks(location: str, message: str) -> None:
    from distlocks.checks import check_settings

    config = {"default": {"BACKEND": BACKEND, "LOCATION": location}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        errors = check_settings()
    assert [error.id for error in errors] == ["distlocks.E004"]
    assert message in str(errors[0].hint)


def test_a_plain_server_named_as_a_cluster_is_a_clear_error() -> None:
    """Not an outage: the settings are wrong, and the error says so."""
    port = int(re.findall(r":(\d+)/", settings.REDIS_URL)[0])
    config = {"default": {"BACKEND": BACKEND, "LOCATION": f"redis+cluster://127.0.0.1:{port}"}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        with pytest.raises(LockError, match="Cluster mode is not enabled") as excinfo:
            lock("plain", timeout=0).acquire()
    assert not isinstance(excinfo.value, LockBackendUnavailable)


def test_no_reachable_node_is_unavailable_quickly(redis_cluster: RedisClusterSet) -> None:
    # Ports nobody listens on: connections are refused.
    config = {
        "default": {"BACKEND": BACKEND, "LOCATION": "redis+cluster://127.0.0.1:1,127.0.0.1:2"}
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable):
            lock("nobody", timeout=10).acquire()
        assert time.monotonic() - start < 5


# -- keys and slots ---------------------------------------------------------------

_MONITOR_LINE = re.compile(r"^\+?[\d.]+ \[\d+ ([^\]]*)\] (.*)$")
_ARGUMENT = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _unquote(text: str) -> str:
    text = re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), text)
    return re.sub(r"\\(.)", r"\1", text)


class Monitor:
    """Every command a server runs (scripts' inner commands included), via MONITOR."""

    def __init__(self, port: int) -> None:
        self.connection = redis.Connection(host="127.0.0.1", port=port, socket_timeout=5)
        self.connection.connect()
        self.connection.send_command("MONITOR")
        assert self.connection.read_response() in (b"OK", "OK")
        self.commands: list[tuple[str, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            # Look before reading: a read that times out would close the connection.
            if not self.connection.can_read(timeout=0.1):
                continue
            line = self.connection.read_response()
            text = line.decode() if isinstance(line, bytes) else str(line)
            match = _MONITOR_LINE.match(text)
            if match:
                source, rest = match.groups()
                args = [_unquote(arg) for arg in _ARGUMENT.findall(rest)]
                self.commands.append(("lua" if source == "lua" else "client", args))

    def saw(self, args: list[str]) -> bool:
        return any(seen == args for _, seen in list(self.commands))

    def stop(self) -> list[tuple[str, list[str]]]:
        self._stop.set()
        self._thread.join(5)
        self.connection.disconnect()
        return self.commands


def test_every_key_an_operation_touches_is_in_the_lock_slot(own_redis: RedisServer) -> None:
    """All lock operations, watched on a server of their own: each key any command
    touches (those run inside the scripts too) is in the slot of the lock's keys, and
    scripts touch only the keys they were given, apart from fair waiters' wake-up lists."""
    name = "slotcheck"
    # Without the listing index, as on a cluster (its hash is in a slot of its own).
    options = {"listing_index": False}
    config = {"default": {"BACKEND": BACKEND, "LOCATION": own_redis.url, "OPTIONS": options}}
    plain = redis.Redis(port=own_redis.port, decode_responses=True)
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = cluster_backend("default")
        keys = backend.all_keys(name)
        holder = current_holder()
        assert backend.acquire("warm-up", "w", 5, holder).acquired  # connect, load scripts
        backend.force_release("warm-up")
        plain.delete(*backend.all_keys("warm-up"))

        monitor = Monitor(own_redis.port)
        plain.echo("start")
        wait_for(lambda: monitor.saw(["ECHO", "start"]), what="monitor running")
        assert backend.acquire(name, "A", 30, holder).acquired
        assert not backend.acquire(name, "B", 30, holder, wait=5).acquired
        assert not backend.acquire(name, "C", 30, holder, wait=5, fair=True).acquired
        backend.wait(name, 0.02, owner="B")
        backend.wait(name, 0.02, owner="C", fair=True)
        assert backend.extend(name, "A", 30)
        assert backend.inspect(name) is not None
        assert backend.fencing_counter(name) > 0
        assert [info.name for info in backend.iter_locks()] == [name]
        assert backend.release(name, "A")  # wakes C, the head of the fair queue
        assert backend.acquire(name, "C", 30, holder, wait=5, fair=True).acquired
        backend.leave_queue(name, "B")
        assert backend.force_release(name)
        asyncio.run(backend.aextend(name, "C", 30))
        # A server runs commands in order: once this one shows, all the above have.
        plain.echo("end")
        wait_for(lambda: monitor.saw(["ECHO", "end"]), what="every command seen")
        commands = monitor.stop()

    slot = key_slot(keys.lock.encode())
    declared: list[str] = []
    undeclared: set[str] = set()
    evalshas = 0
    for source, args in commands:
        if not args or args[0] in ("ECHO", "MONITOR"):
            continue
        if source == "client" and args[0].upper() == "EVALSHA":
            evalshas += 1
            declared = args[3 : 3 + int(args[2])]
        try:
            touched = list(plain.command_getkeys(*args))
        except redis.ResponseError:  # a command without keys (TIME, SCAN...)
            touched = []
        for key in touched:
            assert key_slot(key.encode()) == slot, (key, args)
            if source == "lua" and key not in declared:
                undeclared.add(key)
    assert evalshas >= 10
    # The only keys a script was not given: the wake-up lists of fair waiters, pushed
    # to at a release (C) or dropped when a waiter leaves (B).
    assert undeclared == {keys.wake_prefix + "C", keys.wake_prefix + "B"}
    plain.close()


def test_keys_of_every_lock_share_one_slot_on_the_cluster(topology_alias: str) -> None:
    backend = cluster_backend(topology_alias)
    for lock_name in ("plain", "with{brace", "}x", "{}", "ü:ñ"):
        slots = {key_slot(key.encode()) for key in backend.all_keys(lock_name)}
        assert len(slots) == 1
        with lock(lock_name, backend=topology_alias, timeout=0) as lease:
            assert backend.inspect(lock_name) is not None
        assert backend.fencing_counter(lock_name) == lease.fencing_token


def test_iter_locks_lists_the_locks_of_every_primary(
    redis_cluster: RedisClusterSet, topology_alias: str, name: str
) -> None:
    backend = cluster_backend(topology_alias)
    names = [name_on(redis_cluster, backend, node, name) for node in primaries(redis_cluster)]
    assert len(names) == 3
    leases = [lock(n, backend=topology_alias, ttl=30).acquire() for n in names]
    try:
        listed = {info.name: info for info in backend.iter_locks() if info.name.startswith(name)}
        assert set(listed) == set(names)
        for lease in leases:
            assert listed[lease.name].owner == lease.owner
            assert listed[lease.name].fencing_token == lease.fencing_token
    finally:
        for lease in leases:
            lease.release()


# Commands nodes send each other, or that the measurement itself sends.
_BACKGROUND = {"info", "ping", "replconf", "psync", "sync", "cluster", "config"}


class CommandCounter:
    """Top-level commands the primaries receive (INFO commandstats), on connections
    opened beforehand so that their own set-up is not counted."""

    def __init__(self, cluster: RedisClusterSet) -> None:
        self.clients = [node.client() for node in primaries(cluster)]
        for client in self.clients:
            client.ping()

    def reset(self) -> None:
        for client in self.clients:
            client.config_resetstat()

    def calls(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for client in self.clients:
            for key, value in client.info("commandstats").items():
                command = key.removeprefix("cmdstat_")
                if command not in _BACKGROUND | SCRIPT_INNER:
                    totals[command] = totals.get(command, 0) + value["calls"]
        return totals

    def errors(self) -> dict[str, int]:
        """Error replies sent, by prefix (INFO errorstats): MOVED, NOSCRIPT..."""
        totals: dict[str, int] = {}
        for client in self.clients:
            for key, value in client.info("errorstats").items():
                error = key.removeprefix("errorstat_")
                totals[error] = totals.get(error, 0) + value["count"]
        return totals

    def close(self) -> None:
        for client in self.clients:
            client.close()


def test_each_operation_is_one_evalsha(
    redis_cluster: RedisClusterSet, topology_alias: str, name: str
) -> None:
    backend = cluster_backend(topology_alias)
    holder = current_holder()
    names = [f"{name}:{i}" for i in range(10)]
    for n in names:  # warm up: connections to every primary, scripts loaded
        assert backend.acquire(n, "warm", 5, holder).acquired
        assert backend.extend(n, "warm", 5)
        assert backend.release(n, "warm")
    counter = CommandCounter(redis_cluster)
    try:
        counter.reset()
        for n in names:
            assert backend.acquire(n, "owner", 5, holder).acquired
        assert counter.calls() == {"evalsha": 10}
        counter.reset()
        for n in names:
            assert backend.extend(n, "owner", 5)
            assert backend.release(n, "owner")
        assert counter.calls() == {"evalsha": 20}
    finally:
        counter.close()


def test_a_new_event_loops_first_calls_go_to_the_right_primary(
    redis_cluster: RedisClusterSet, topology_alias: str, name: str
) -> None:
    """Each event loop gets its own asyncio client. Its first operations, started
    together before it has read the slot map, still go straight to the primary of
    their slot: no MOVED reply, and every one of them succeeds."""
    backend = cluster_backend(topology_alias)
    holder = current_holder()
    names = [f"{name}:{i}" for i in range(12)]
    slots = [key_slot(backend.all_keys(n).lock.encode()) for n in names]
    assert len({redis_cluster.master_for_slot(slot).port for slot in slots}) == 3

    async def main() -> list[bool]:
        granted = await asyncio.gather(*(backend.aacquire(n, "o", 5, holder) for n in names))
        released = await asyncio.gather(*(backend.arelease(n, "o") for n in names))
        return [g.acquired for g in granted] + list(released)

    counter = CommandCounter(redis_cluster)
    try:
        for _ in range(3):  # a fresh client (and event loop) each time
            counter.reset()
            assert all(asyncio.run(main()))
            assert counter.errors().get("MOVED", 0) == 0
    finally:
        counter.close()


# -- a primary lost ---------------------------------------------------------------


def _replica_has(node: RedisClusterNode, key: str, value: int) -> bool:
    client = node.client()
    try:
        client.execute_command("READONLY")  # reads on a replica of a cluster
        return int(client.get(key) or 0) == value
    finally:
        client.close()


def test_primary_loss_fails_over_while_other_slots_keep_working(
    redis_cluster: RedisClusterSet, topology_alias: str, name: str
) -> None:
    """A primary with a replica is killed. While the cluster fails over, locks on the
    other primaries keep working, and those of the lost slots fail fast with
    LockBackendUnavailable; afterwards they work again, on the promoted replica,
    through the same backend (sync and asyncio), with tokens still increasing."""
    backend = cluster_backend(topology_alias)
    victim = next(node for node in primaries(redis_cluster) if redis_cluster.replicas_of(node))
    (replica,) = redis_cluster.replicas_of(victim)
    other = next(node for node in primaries(redis_cluster) if node is not victim)
    lost_name = name_on(redis_cluster, backend, victim, f"{name}:lost")
    other_name = name_on(redis_cluster, backend, other, f"{name}:other")
    loop = asyncio.new_event_loop()  # one loop: its client lives through the failover

    async def take(lock_name: str) -> int:
        async with alock(lock_name, backend=topology_alias, ttl=10, timeout=0) as lease:
            return lease.fencing_token

    holder = lock(lost_name, backend=topology_alias, ttl=120, auto_renew=False).acquire()
    tokens = [holder.fencing_token, loop.run_until_complete(take(other_name))]
    fence = backend.all_keys(lost_name).fence
    wait_for(lambda: _replica_has(replica, fence, holder.fencing_token), what="replicated")

    try:
        victim.kill()
        failures: list[float] = []
        served_elsewhere = 0
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "no failover within 60 s"
            # The other primaries' slots are not affected.
            with lock(other_name, backend=topology_alias, ttl=10, timeout=0) as lease:
                tokens.append(lease.fencing_token)
            tokens.append(loop.run_until_complete(take(other_name)))
            served_elsewhere += 1
            start = time.monotonic()
            try:
                info = backend.inspect(lost_name)
                break
            except LockBackendUnavailable:
                failures.append(time.monotonic() - start)
                time.sleep(0.05)
        # The slot was served by nobody for at least the node timeout.
        assert failures and served_elsewhere >= 1
        assert max(failures) < 5, failures
        # Every running node names the replica for the slot soon after it serves it
        # (until then, a client re-reading the slot map from a node yet to hear of the
        # failover would still send the lock's calls to the dead primary).
        slot = key_slot(backend.all_keys(lost_name).lock.encode())
        wait_for(
            lambda: set(redis_cluster.slot_views(slot)) == {replica.port},
            30,
            what="every node naming the replica",
        )
        # The lock had reached the replica before the kill: it is still held.
        assert info is not None and info.owner == holder.owner
        with pytest.raises(LockNotAcquired):
            lock(lost_name, backend=topology_alias, timeout=0).acquire()
        assert holder.release() is True
        with lock(lost_name, backend=topology_alias, timeout=0) as lease:
            assert lease.fencing_token > holder.fencing_token
        assert loop.run_until_complete(take(lost_name)) > lease.fencing_token
        assert tokens[1:] == sorted(set(tokens[1:]))
    finally:
        loop.close()
        # The old primary comes back as a replica of the promoted one.
        victim.start(port=victim.port)
        wait_for(redis_cluster.healthy, 60, what="cluster healthy again")
        assert redis_cluster.replicas_of(replica) == [victim]


# -- clean-up -----------------------------------------------------------------------

CHILD = """
import sys, time
from distlocks.testing.servers import RedisClusterSet, RedisSentinelSet
kind = sys.argv[1]
if kind == "cluster":
    servers = RedisClusterSet(masters=1, replicas=1).start()
else:
    servers = RedisSentinelSet(sentinels=1, quorum=1).start()
pids = [server.pid for server in servers.servers()]
print(servers.base_dir, *pids, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "signum"), [("cluster", signal.SIGTERM), ("sentinel", signal.SIGKILL)]
)
def test_servers_stop_when_their_process_dies(kind: str, signum: int) -> None:
    """Killed outright, the owner cannot clean up: its servers die with it (parent-death
    signal) and its directory is swept at the next start; stopped, it cleans up itself."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert child.stdout is not None
    base_dir, *pids = child.stdout.readline().split()
    assert len(pids) >= 2 and all(process_alive(int(pid)) for pid in pids)
    child.send_signal(signum)
    child.wait(30)
    assert not wait_gone([int(pid) for pid in pids]), "servers still running"
    if signum == signal.SIGKILL:
        assert Path(base_dir).exists()
        servers._sweep_stale_run_dirs()
    assert not Path(base_dir).exists()


def test_renewal_in_batches_on_the_cluster(
    redis_cluster: RedisClusterSet, topology_alias: str, name: str
) -> None:
    """extend_many groups the leases by node: one pipeline per primary, each lease
    renewed once (no retry on its own), and the answers in the leases' order."""
    backend = cluster_backend(topology_alias)
    holder = current_holder()
    names = [f"{name}:{i}" for i in range(90)]
    for n in names:
        assert backend.acquire(n, "owner", 5, holder).acquired
    assert backend.release(names[7], "owner")  # no longer held
    leases = [(n, "owner", 30.0) for n in names] + [(names[8], "someone-else", 30.0)]
    # The first batch on a node without the script loads it there, then runs again.
    for node in backend.client.get_primaries():
        node.redis_connection.script_flush()
    assert backend.extend_many(leases[:30]) == [True] * 7 + [False] + [True] * 22
    counter = CommandCounter(redis_cluster)
    try:
        counter.reset()
        results = backend.extend_many(leases)
        assert counter.calls() == {"evalsha": 91}
    finally:
        counter.close()
    expected = [True] * 90 + [False]
    expected[7] = False
    assert results == expected
    client = backend.client
    assert client.pttl(backend.all_keys(names[0]).lock) > 20_000  # renewed to 30 s
    for n in names:
        backend.release(n, "owner")
