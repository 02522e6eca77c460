"""RedisBackend specifics: round trips, key layout, connections, failures."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.test import override_settings
from redis.cluster import key_slot

from distlocks import get_backend, lock
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable
from distlocks.locks import current_holder
from distlocks.testing.servers import RedisServer


def redis_config(**entry: object) -> dict[str, dict[str, object]]:
    return {"default": {"BACKEND": "distlocks.backends.redis.RedisBackend", **entry}}


# Commands the scripts themselves run on the server; INFO commandstats counts them
# too, but they are not round trips.
SCRIPT_INNER = {
    "hget", "incr", "time", "hset", "pexpire", "pttl", "del", "hincrby", "exists", "get", "set",
    "zadd", "zrem", "zrange", "zrangebyscore", "zremrangebyscore", "zcard", "rpush", "ltrim",
    "hdel", "hmget", "hscan",  # the listing index and its sweep (kept by the same scripts)
    "hlen", "strlen", "scard", "llen",  # the type probes before a script's first write
}  # fmt: skip
# Commands of the measurement itself.
MEASUREMENT = {"config|resetstat", "config", "info"}


def round_trips(client: redis.Redis) -> dict[str, int]:
    """Top-level commands received since the last CONFIG RESETSTAT, by name."""
    stats = client.info("commandstats")
    calls = {key.removeprefix("cmdstat_"): value["calls"] for key, value in stats.items()}
    return {k: v for k, v in calls.items() if k not in SCRIPT_INNER | MEASUREMENT}


@pytest.mark.parametrize("lock_name", ["plain", "with{brace", "with}brace", "}x", "{}", "ü:ñ"])
def test_keys_of_one_lock_share_a_cluster_slot(lock_name: str) -> None:
    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)
    lock_key, fence_key = backend.keys(lock_name)
    assert lock_key.startswith("distlocks-test:{")
    assert key_slot(lock_key.encode()) == key_slot(fence_key.encode())


def test_names_with_braces_work(name: str) -> None:
    for odd in (f"{{{name}", f"{name}}}", f"}}{name}{{"):
        with lock(odd, backend="redis") as lease:
            assert get_backend("redis").inspect(odd) is not None
            assert lease.fencing_token > 0


def test_holder_metadata_is_stored_in_one_hash(redis_client: redis.Redis, name: str) -> None:
    from distlocks.locks import holder_extra

    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)
    token = holder_extra.set({"task_id": "abc-123"})
    try:
        lease = lock(name, backend="redis", ttl=7).acquire()
    finally:
        holder_extra.reset(token)
    try:
        fields = redis_client.hgetall(backend.keys(name)[0])
        assert fields[b"owner"] == lease.owner.encode()
        assert int(fields[b"token"]) == lease.fencing_token
        assert fields[b"ttl"] == b"7000"
        assert 0 < redis_client.pttl(backend.keys(name)[0]) <= 7000
        info = backend.inspect(name)
        assert info is not None and info.extra == {"task_id": "abc-123"}
    finally:
        lease.release()
    assert redis_client.exists(backend.keys(name)[0]) == 0
    # The fencing counter outlives the lock.
    assert int(redis_client.get(backend.keys(name)[1]) or 0) == lease.fencing_token


def test_key_prefix_option(redis_client: redis.Redis, name: str) -> None:
    from django.conf import settings

    config = redis_config(LOCATION=settings.REDIS_URL, OPTIONS={"key_prefix": "custom"})
    with override_settings(DISTLOCKS_BACKENDS=config), lock(name):
        assert redis_client.exists(f"custom:{{{name}}}:lock") == 1


def test_iter_locks_lists_many(name: str) -> None:
    backend = get_backend("redis")
    leases = [lock(f"{name}:{i}", backend="redis").acquire() for i in range(25)]
    try:
        mine = {info.name for info in backend.iter_locks() if info.name.startswith(name)}
        assert mine == {f"{name}:{i}" for i in range(25)}
    finally:
        for lease in leases:
            lease.release()


def test_connection_from_django_redis_cache(name: str) -> None:
    with override_settings(DISTLOCKS_BACKENDS=redis_config(CACHE="redis")):
        backend = get_backend()
        with lock(name) as lease:
            assert backend.inspect(name) is not None
            assert lease.fencing_token > 0
        # Our own pool, with our timeouts even though the cache set none.
        assert isinstance(backend, RedisBackend)
        kwargs = backend.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == RedisBackend.DEFAULT_SOCKET_TIMEOUT


def test_connection_over_a_unix_socket(own_redis: RedisServer, name: str) -> None:
    with override_settings(DISTLOCKS_BACKENDS=redis_config(LOCATION=own_redis.unix_url)):
        with lock(name) as lease:
            assert get_backend().inspect(name) is not None
        assert lease.state == "released"
    direct = redis.Redis(unix_socket_path=str(own_redis.socket_path))
    assert int(direct.get(f"distlocks-test:{{{name}}}:fence") or 0) == lease.fencing_token


def test_refused_connection_is_unavailable_quickly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        config = redis_config(LOCATION=f"redis://127.0.0.1:{port}/0")
        with override_settings(DISTLOCKS_BACKENDS=config):
            start = time.monotonic()
            with pytest.raises(LockBackendUnavailable) as excinfo:
                lock("refused", timeout=0).acquire()
            elapsed = time.monotonic() - start
    assert isinstance(excinfo.value.__cause__, redis.ConnectionError)
    assert excinfo.value.backend == "default"
    assert elapsed < 5, f"took {elapsed:.1f}s"


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers (a hung Redis)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_silent_server_is_unavailable_without_hanging(silent_server: int) -> None:
    config = redis_config(
        LOCATION=f"redis://127.0.0.1:{silent_server}/0", OPTIONS={"socket_timeout": 0.5}
    )
    with override_settings(DISTLOCKS_BACKENDS=config):
        start = time.monotonic()
        with pytest.raises(LockBackendUnavailable) as excinfo:
            lock("silent", timeout=10).acquire()
        elapsed = time.monotonic() - start
    assert isinstance(excinfo.value.__cause__, redis.TimeoutError)
    # One timed-out acquire plus one timed-out best-effort release, never the 10 s wait.
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_server_restart_is_survived_by_the_pool(own_redis: RedisServer, name: str) -> None:
    """A pooled connection broken by a restart is replaced, not reported as an outage."""
    with override_settings(DISTLOCKS_BACKENDS=redis_config(LOCATION=own_redis.url)):
        with lock(name):
            pass
        port = own_redis.port
        own_redis.kill()
        own_redis.start(port=port)
        with lock(name) as lease:
            assert lease.held()


def test_server_down_then_up(own_redis: RedisServer, name: str) -> None:
    with override_settings(DISTLOCKS_BACKENDS=redis_config(LOCATION=own_redis.url)):
        port = own_redis.port
        own_redis.kill()
        with pytest.raises(LockBackendUnavailable):
            lock(name, timeout=0).acquire()
        own_redis.start(port=port)
        with lock(name, timeout=0) as lease:
            assert lease.held()


def test_iter_locks_with_glob_characters_in_the_prefix(name: str) -> None:
    from django.conf import settings

    def config(prefix: str) -> dict[str, dict[str, object]]:
        return redis_config(LOCATION=settings.REDIS_URL, OPTIONS={"key_prefix": prefix})

    with override_settings(DISTLOCKS_BACKENDS=config("app1")), lock(name):
        with override_settings(DISTLOCKS_BACKENDS=config("app[1]")):
            # "app[1]" as a glob would match "app1"; as a prefix it must not.
            assert [i.name for i in get_backend().iter_locks() if i.name == name] == []
            with lock(name):
                assert [i.name for i in get_backend().iter_locks() if i.name == name] == [name]


@pytest.fixture
def quiet_redis(tmp_path: Path) -> Iterator[tuple[str, redis.Redis]]:
    """A server of its own: renewals of other tests' leases must not be counted."""
    server = RedisServer(tmp_path).start()
    config = redis_config(LOCATION=server.url)
    client = redis.Redis.from_url(server.url)
    with override_settings(DISTLOCKS_BACKENDS={**config, "redis": config["default"]}):
        yield "redis", client
    client.close()
    server.stop()


def test_acquire_is_one_round_trip(quiet_redis: tuple[str, redis.Redis], name: str) -> None:
    """Counted on the server: each acquire is exactly one EVALSHA and nothing else."""
    _, redis_client = quiet_redis
    backend = get_backend("redis")
    assert isinstance(backend, RedisBackend)
    holder = current_holder()
    # Warm up: connect and load the scripts once.
    assert backend.acquire(name, "warm", 5, holder).acquired
    assert backend.extend(name, "warm", 5)
    assert backend.release(name, "warm")

    redis_client.config_resetstat()
    for i in range(10):
        assert backend.acquire(f"{name}:{i}", f"owner-{i}", 5, holder).acquired
    assert round_trips(redis_client) == {"evalsha": 10}

    redis_client.config_resetstat()
    for i in range(10):
        assert backend.extend(f"{name}:{i}", f"owner-{i}", 5)
        assert backend.release(f"{name}:{i}", f"owner-{i}")
    assert round_trips(redis_client) == {"evalsha": 20}


def test_public_api_cycle_is_two_round_trips(
    quiet_redis: tuple[str, redis.Redis], name: str
) -> None:
    _, redis_client = quiet_redis
    with lock(name, backend="redis", ttl=5):
        pass  # warm up
    redis_client.config_resetstat()
    with lock(name, backend="redis", ttl=5):
        pass
    assert round_trips(redis_client) == {"evalsha": 2}
