"""RedisBackend through Redis Sentinel: the primary is found by asking the Sentinels,
and a failover (a switchover, then a primary killed before it could replicate its
last write) is followed without restarting anything, with tokens still increasing.

The set-up (a primary, one replica, three Sentinels with a quorum of two) is started
once per test session, on first use. The contract tests imported below run here
again, on the Sentinel alias (their ``alias`` fixtures are overridden in this module).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
import redis
from django.test import override_settings

from distlocks import alock, lock
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable
from distlocks.locks import current_holder
from distlocks.testing.servers import RedisSentinelSet, RedisServer, ServerError
from tests.redis_contract import *  # noqa: F403 - the contract tests, on this alias
from tests.redis_contract import BACKEND, redis_alias, redis_backend
from tests.test_redis import SCRIPT_INNER
from tests.waiting import wait_for


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[RedisSentinelSet]:
    """A primary with one replica; a primary silent for 2 s is failed over."""
    sentinel = RedisSentinelSet(replicas=1, sentinels=3, quorum=2, down_after_ms=2000).start()
    yield sentinel
    sentinel.close()


@pytest.fixture
def topology_alias(redis_sentinel: RedisSentinelSet) -> Iterator[str]:
    with redis_alias("sentinel", redis_sentinel.url) as alias:
        yield alias


sentinel_backend = redis_backend


def direct(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


def replication(server: RedisServer) -> dict[str, object]:
    client = direct(server)
    try:
        return dict(client.info("replication"))
    finally:
        client.close()


def _fence_on(server: RedisServer, key: str) -> int:
    client = direct(server)
    try:
        return int(client.get(key) or 0)
    finally:
        client.close()


def running(server: RedisServer) -> bool:
    return server.process is not None and server.process.poll() is None


# -- configuration ----------------------------------------------------------------


def test_sentinel_location_leads_to_the_primary(
    redis_sentinel: RedisSentinelSet, topology_alias: str, name: str
) -> None:
    backend = sentinel_backend(topology_alias)
    assert backend.mode == "sentinel"
    with lock(name, backend=topology_alias, timeout=0) as lease:
        primary = direct(redis_sentinel.current_master())
        try:
            # The lock lives on the primary the Sentinels name, in database 0.
            assert int(primary.get(backend.all_keys(name).fence) or 0) == lease.fencing_token
        finally:
            primary.close()
    kwargs = backend.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == RedisBackend.DEFAULT_SOCKET_TIMEOUT


def test_database_and_sentinel_options_are_applied(
    redis_sentinel: RedisSentinelSet, name: str
) -> None:
    location = redis_sentinel.url.removesuffix("/0") + "/3"
    config = {
        "default": {
            "BACKEND": BACKEND,
            "LOCATION": location,
            "OPTIONS": {"socket_timeout": 2.0, "sentinel_kwargs": {"client_name": "probe"}},
        }
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        backend = sentinel_backend("default")
        with lock(name, timeout=0) as lease:
            pass
        assert backend.wait_chunk == pytest.approx(1.6)
        sentinel = backend._sentinel
        assert sentinel is not None
        assert sentinel.sentinels[0].connection_pool.connection_kwargs["client_name"] == "probe"
    primary = redis.Redis(port=redis_sentinel.current_master().port, db=3)
    try:
        assert int(primary.get(backend.all_keys(name).fence) or 0) == lease.fencing_token
    finally:
        primary.close()


@pytest.mark.parametrize(
    ("location", "options", "message"),
    [
        ("redis+sentinel://127.0.0.1:26379", {}, "must name the service"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", {}, "database 'x' is not a number"),
        ("redis+sentinel://127.0.0.1:26379/svc/0/1", {}, "must name the service"),
        ("redis+sentinel://:26379/svc", {}, "a node that is not host:port"),
        ("redis+sentinel://127.0.0.1:1/svc", {"sentinel_kwargs": "pw"}, "must be a dict"),
        ("redis://127.0.0.1:1/0", {"sentinel_kwargs": {}}, "only read with a redis+sentinel"),
    ],
)
def test_bad_sentinel_settings_fail_the_checks(
    location: str, options: dict[str, object], message: str
) -> None:
    from distlocks.checks import check_settings

    config = {"default": {"BACKEND": BACKEND, "LOCATION": location, "OPTIONS": options}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        errors = check_settings()
    assert [error.id for error in errors] == ["distlocks.E004"]
    assert message in str(errors[0].hint)


def test_no_reachable_sentinel_is_unavailable_quickly() -> None:
    # Ports nobody listens on: connections are refused.
    config = {
        "default": {"BACKEND": BACKEND, "LOCATION": "redis+sentinel://127.0.0.1:1,127.0.0.1:2/x"}
    }
    with override_settings(DISTLOCKS_BACKENDS=config):
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable, match="No master found for 'x'"):
            lock("nobody", timeout=10).acquire()
        assert time.monotonic() - start < 5


def test_unknown_service_is_reported_by_name(redis_sentinel: RedisSentinelSet) -> None:
    location = redis_sentinel.url.replace(f"/{redis_sentinel.service}/", "/no-such-service/")
    config = {"default": {"BACKEND": BACKEND, "LOCATION": location}}
    with override_settings(DISTLOCKS_BACKENDS=config):
        with pytest.raises(LockBackendUnavailable, match="'no-such-service'"):
            lock("nobody", timeout=0).acquire()


# Commands Sentinels and replicas send the primary, or the measurement itself sends.
_BACKGROUND = {"info", "ping", "publish", "replconf", "psync", "sync", "config"}


def test_each_operation_is_one_evalsha(
    redis_sentinel: RedisSentinelSet, topology_alias: str, name: str
) -> None:
    backend = sentinel_backend(topology_alias)
    holder = current_holder()
    assert backend.acquire(name, "warm", 5, holder).acquired  # connect, load the scripts
    assert backend.release(name, "warm")
    primary = direct(redis_sentinel.current_master())

    def calls() -> dict[str, int]:
        stats = primary.info("commandstats")
        return {
            key.removeprefix("cmdstat_"): value["calls"]
            for key, value in stats.items()
            if key.removeprefix("cmdstat_") not in _BACKGROUND | SCRIPT_INNER
        }

    try:
        primary.config_resetstat()
        for i in range(10):
            assert backend.acquire(f"{name}:{i}", "owner", 5, holder).acquired
        assert calls() == {"evalsha": 10}
        primary.config_resetstat()
        for i in range(10):
            assert backend.extend(f"{name}:{i}", "owner", 5)
            assert backend.release(f"{name}:{i}", "owner")
        assert calls() == {"evalsha": 20}
    finally:
        primary.close()


# -- failover ---------------------------------------------------------------------


def test_switchover_is_followed_without_a_restart(
    redis_sentinel: RedisSentinelSet, topology_alias: str, name: str
) -> None:
    """SENTINEL FAILOVER swaps the roles while both servers run: the connections to
    the old primary are closed by Sentinel, and the next calls (sync and asyncio, on
    their existing clients) reach the new primary."""
    wait_for(redis_sentinel.sentinels_ready, 60, what="Sentinels ready")
    backend = sentinel_backend(topology_alias)
    loop = asyncio.new_event_loop()  # one loop: its client lives through the switchover

    async def take() -> int:
        async with alock(name, backend=topology_alias, ttl=10, timeout=0) as lease:
            return lease.fencing_token

    try:
        with lock(name, backend=topology_alias, timeout=0) as before:
            pass
        tokens = [before.fencing_token, loop.run_until_complete(take())]
        old = redis_sentinel.current_master()
        sentinel = redis_sentinel.sentinels[0].client()
        try:
            sentinel.execute_command("SENTINEL", "FAILOVER", redis_sentinel.service)
        finally:
            sentinel.close()
        wait_for(lambda: redis_sentinel.current_master() is not old, 30, what="switchover")
        new = redis_sentinel.current_master()
        wait_for(lambda: replication(old)["role"] == "slave", 30, what="demoted")
        deadline = time.monotonic() + 30
        while True:  # until the new primary takes writes (it may still be promoting)
            try:
                with lock(name, backend=topology_alias, timeout=0) as after:
                    break
            except LockBackendUnavailable:
                assert time.monotonic() < deadline, "the new primary took no writes"
                time.sleep(0.05)
        tokens += [after.fencing_token, loop.run_until_complete(take())]
        assert tokens == sorted(set(tokens))
        assert _fence_on(new, backend.all_keys(name).fence) == tokens[-1]
    finally:
        loop.close()


def test_primary_killed_before_replicating_tokens_keep_increasing(
    redis_sentinel: RedisSentinelSet, topology_alias: str, name: str
) -> None:
    """The replica is cut off, a lock is taken (a write it never gets), and the primary
    is killed. Sentinel promotes the replica, which has never heard of that lease, so
    the lock is granted a second time: the fencing token of that second grant is still
    higher than every earlier one (the counter falls back to the server clock), and
    the backend follows the new primary without a restart, sync and asyncio alike."""
    wait_for(redis_sentinel.sentinels_ready, 60, what="Sentinels ready")
    backend = sentinel_backend(topology_alias)
    primary = redis_sentinel.current_master()
    (replica,) = [n for n in redis_sentinel.redis_nodes if n is not primary and running(n)]
    fence = backend.all_keys(name).fence
    loop = asyncio.new_event_loop()  # one loop: its client lives through the failover

    async def take() -> int:
        async with alock(name, backend=topology_alias, ttl=10, timeout=0) as lease:
            return lease.fencing_token

    try:
        with lock(name, backend=topology_alias, timeout=0) as first:
            pass
        replicated = loop.run_until_complete(take())
        assert replicated > first.fencing_token
        wait_for(lambda: _fence_on(replica, fence) == replicated, what="replicated")

        redis_sentinel.pause_replication()
        wait_for(
            lambda: replication(replica)["master_link_status"] == "down",
            what="replica cut off",
        )
        stale = lock(name, backend=topology_alias, ttl=120, auto_renew=False).acquire()
        assert stale.fencing_token > replicated
        assert _fence_on(replica, fence) == replicated  # the replica never got it

        primary.kill()
        failures: list[float] = []
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "no failover within 60 s"
            start = time.monotonic()
            try:
                second = lock(name, backend=topology_alias, ttl=30, timeout=0).acquire()
                break
            except LockBackendUnavailable:
                failures.append(time.monotonic() - start)
                time.sleep(0.05)
        # Unavailable (fast) until a replica was promoted, then served by it.
        assert failures and max(failures) < 5, failures
        # The Sentinels agree a moment after the failover: the one asked first may still
        # name the old primary when the client, told by another, already writes to the new.
        wait_for(
            lambda: redis_sentinel.current_master() is replica,
            30,
            what="the first Sentinel that answers naming the replica",
        )

        # Granted twice: the stale holder still believes it holds the lock...
        assert stale.held()
        # ...but its token is lower than the second holder's, so fenced writes reject it.
        assert second.fencing_token > stale.fencing_token > replicated
        assert _fence_on(replica, fence) == second.fencing_token
        assert stale.release() is False  # and it cannot free the second holder's lock
        info = backend.inspect(name)
        assert info is not None and info.owner == second.owner
        second.release()
        assert loop.run_until_complete(take()) > second.fencing_token
    finally:
        loop.close()
        # The old primary comes back as a replica of the new one (for later tests).
        redis_sentinel.resume_replication()
        primary.extra_args += redis_sentinel.replica_args(replica.port)
        with contextlib.suppress(ServerError):  # its port was taken meanwhile
            primary.start(port=primary.port)
