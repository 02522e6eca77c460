"""Failovers of a replicated Redis under running workers: a Sentinel-managed primary
and a Redis Cluster primary, each killed (SIGKILL) while a worker is inside its
critical section, and replaced by its replica.

Replication is asynchronous, so what a failover does to a lease depends on whether
the replica had seen it. The two scenarios take the two cases on purpose, instead of
leaving it to timing: on Sentinel the replica is cut off before the holder's grant, so
the promoted replica grants the lock a second time and fencing has to refuse the old
holder; on Cluster the test waits until the grant has reached the replica, so the
lease must survive the failover and keep everybody else out until its holder releases.

Each test starts a replicated set of its own (requested before ``scenario``, so that
the workers are gone before it is torn down): killing a primary of the session's
cluster would disturb the modules that share it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings
from redis.cluster import key_slot

from distlocks import lock
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable, LockNotAcquired
from distlocks.testing.servers import (
    RedisClusterNode,
    RedisClusterSet,
    RedisSentinelSet,
    RedisServer,
)
from tests.faults.helpers import MakeScenario, newer_write, of, redis_config
from tests.faults.scenario import LIMIT
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: The lease of the worker that is inside when the primary dies: long enough to
#: outlast any failover, so that whatever happens to it is the failover's doing,
#: not its expiry.
HOLDER_TTL = 30.0
#: The other workers' lease.
TTL = 1.0


@pytest.fixture
def sentinel_set() -> Iterator[RedisSentinelSet]:
    """A primary with one replica, three Sentinels, a quorum of two."""
    servers = RedisSentinelSet(replicas=1, sentinels=3, quorum=2, down_after_ms=1500).start()
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture
def cluster_set() -> Iterator[RedisClusterSet]:
    """Three primaries (a majority of them survives the loss of one, so the cluster
    can elect a replica), the first with a replica; a node silent for 1 s fails."""
    servers = RedisClusterSet(masters=3, replicas=1, node_timeout_ms=1000).start()
    try:
        yield servers
    finally:
        servers.close()


def hget_token(client: redis.Redis, key: str) -> int | None:
    value = client.hget(key, "token")
    return None if value is None else int(value)


def on_server(server: RedisServer, key: str, *, field: str | None = None) -> int | None:
    """A lock hash's token (or a counter's value) as one server has it, read directly."""
    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        if isinstance(server, RedisClusterNode):
            client.execute_command("READONLY")  # reads on a cluster replica
        if field is None:
            value = client.get(key)
            return None if value is None else int(value)
        return hget_token(client, key)
    finally:
        client.close()


def role(server: RedisServer) -> str:
    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        return str(client.info("replication")["role"])
    finally:
        client.close()


def tokens_around(events: list[dict[str, Any]], fault: float, since: float
                  ) -> tuple[list[int], list[int]]:  # fmt: skip
    """The tokens of the grants completed before ``fault`` and of those begun after
    ``since`` (grants in between may overlap both in time, so they order with neither)."""
    acquires = [e for e in events if e["kind"] == "acquire"]
    before = [e["token"] for e in acquires if e["t1"] < fault]
    after = [e["token"] for e in acquires if e["t0"] > since]
    return before, after


def test_sentinel_failover_to_a_replica_that_missed_the_grant(
    sentinel_set: RedisSentinelSet, scenario: MakeScenario
) -> None:
    """The worst case of an asynchronous failover, made certain: the replica is cut
    off, w1 is granted the lock (a write the replica never gets) and stops inside, and
    the primary is killed. Sentinel promotes the replica, which grants the lock again
    while w1 still believes it holds it, with a token above w1's (the counter falls
    back to the server clock). The new holder claims the row first, so w1's write is
    refused, and work goes on on the new primary."""
    config = redis_config(sentinel_set.url)
    primary = sentinel_set.current_master()
    (replica,) = [node for node in sentinel_set.redis_nodes if node is not primary]
    keys = RedisBackend("probe", config).all_keys  # key names only, no I/O
    s = scenario("sentinel-failover")
    lock_key, fence_key = keys(s.lock).lock, keys(s.lock).fence
    s.spawn("w1", backend=config, ttl=HOLDER_TTL)
    s.spawn("w2", backend=config, ttl=TTL)
    s.spawn("w3", backend=config, ttl=TTL)
    s.wait_accepted(6)
    # w2 holds the lock while the replica is cut off: everything w1 did before (its
    # long leases included) has reached the replica, and w1's next grant cannot.
    s.hold("w2", "inside")
    w2_token = s.wait_at("w2", "inside")
    wait_for(lambda: on_server(replica, lock_key, field="token") == w2_token, LIMIT,
             "w2's grant on the replica")  # fmt: skip
    sentinel_set.pause_replication()
    s.hold("w1", "inside")
    s.go("w2", "inside")
    token = s.wait_at("w1", "inside")
    replicated = on_server(replica, fence_key)
    assert replicated is not None and replicated < token, "the replica saw w1's grant"
    with s.fault("primary SIGKILLed, Sentinel promoted the cut-off replica", ends_leases=True):
        killed_at = time.monotonic()
        primary.kill()
        wait_for(lambda: sentinel_set.current_master() is replica, LIMIT,
                 "Sentinel naming the replica")  # fmt: skip
    failed_over_at = time.monotonic()
    claim = s.wait_event(newer_write(token), "a newer holder's claim on the promoted replica")
    s.go("w1", "inside")
    late = s.wait_event(of("write", "w1", op="increment", token=token), "w1's late write")
    s.wait_accepted(4, after=failed_over_at, what="progress after the failover")
    s.wait_granted(4, after=failed_over_at, what="grants after the failover")
    s.stop()
    s.join()
    report = s.check()

    assert late["accepted"] is False
    assert report.takeovers >= 1 and report.faults == 1
    # A real double grant: the old primary would have kept w1's lease valid past the
    # second grant (its last confirmation plus its ttl).
    events = s.events()
    confirmed = max(e["t0"] for e in events if e["kind"] in ("acquire", "renew")
                    and e.get("proc") == "w1" and e.get("token") == token)  # fmt: skip
    (second,) = [e for e in s.events("acquire") if e["token"] == claim["token"]]
    assert second["t1"] < confirmed + HOLDER_TTL
    # w1's release reached the new primary, which never had its lease: w1 learns it.
    (release,) = [e for e in s.events("release", "w1") if e["token"] == token]
    assert release["ok"] is False and release["error"].startswith("LockLost")
    before, after = tokens_around(events, killed_at, failed_over_at)
    assert len(after) >= 4 and min(after) > max(before)


def name_on(cluster: RedisClusterSet, backend: RedisBackend, node: RedisClusterNode,
            base: str) -> str:  # fmt: skip
    """A lock name whose keys live in a slot that ``node`` serves."""
    for i in range(10_000):
        candidate = f"{base}:{i}"
        if cluster.master_for_slot(key_slot(backend.all_keys(candidate).lock.encode())) is node:
            return candidate
    raise AssertionError(f"no lock name found on node {node.port}")


def test_cluster_primary_lost_after_the_grant_replicated(
    cluster_set: RedisClusterSet, scenario: MakeScenario
) -> None:
    """The primary serving the lock's slot is killed while w1 is inside, once w1's
    grant has reached the replica. The replica takes over the slot with the lease on
    it: nobody else is granted the lock (the fault is recorded as one that does not
    end leases, so the checker holds w1's lease valid until its release), w1's write
    is accepted and its release frees the lock on the new primary, and work goes on."""
    config = redis_config(cluster_set.url)
    victim = next(node for node in cluster_set.nodes if cluster_set.replicas_of(node))
    (replica,) = cluster_set.replicas_of(victim)
    probe = RedisBackend("probe", config)  # key names only, no I/O
    s = scenario("cluster-failover")
    s.lock = name_on(cluster_set, probe, victim, s.lock)
    lock_key = probe.all_keys(s.lock).lock
    for proc, ttl in (("w1", HOLDER_TTL), ("w2", TTL), ("w3", TTL)):
        s.spawn(proc, backend=config, ttl=ttl)
    s.wait_accepted(6)
    s.hold("w1", "inside")
    token = s.wait_at("w1", "inside")
    wait_for(lambda: on_server(replica, lock_key, field="token") == token, LIMIT,
             "w1's grant on the replica")  # fmt: skip

    backends = {**settings.DISTLOCKS_BACKENDS, "faults": config}

    def refused() -> bool:
        """The lock's slot is served again, and w1's lease is there: a try is refused."""
        try:
            lease = lock(s.lock, backend="faults", timeout=0, auto_renew=False).acquire()
        except LockBackendUnavailable:
            return False
        except LockNotAcquired:
            return True
        lease.release()
        raise AssertionError("the promoted replica granted a lock whose lease it had")

    with s.fault("primary of the lock's slot SIGKILLed, its replica took over"):
        killed_at = time.monotonic()
        victim.kill()
        wait_for(lambda: role(replica) == "master", LIMIT, "the replica promoted")
        with override_settings(DISTLOCKS_BACKENDS=backends):
            wait_for(refused, LIMIT, "the lock's slot served by the promoted replica")
    failed_over_at = time.monotonic()
    slot = key_slot(lock_key.encode())
    # Until every node names the new primary, a client that re-reads the slot map from
    # a node yet to hear of it still sends the lock's calls to the dead one.
    wait_for(lambda: set(cluster_set.slot_views(slot)) == {replica.port}, LIMIT,
             "every node naming the replica for the lock's slot")  # fmt: skip
    s.go("w1", "inside")
    mine = s.wait_event(of("write", "w1", op="increment", token=token), "w1's write")
    s.wait_accepted(4, after=failed_over_at, what="progress after the failover")
    s.wait_granted(4, after=failed_over_at, what="grants after the failover")
    s.stop()
    s.join()
    report = s.check()

    assert mine["accepted"] is True
    (release,) = [e for e in s.events("release", "w1") if e["token"] == token]
    assert release["ok"] is True
    assert report.faults == 1
    # Nobody else was granted the lock between the kill and w1's release (the
    # checker proves it too, since the fault does not end leases).
    between = [e for e in s.events("acquire") if killed_at < e["t1"] < release["t0"]]
    assert between == []
    before, after = tokens_around(s.events(), killed_at, failed_over_at)
    assert len(after) >= 4 and min(after) > max(before)
