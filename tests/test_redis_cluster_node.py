"""A Redis Cluster node named as one server (``redis://host:port``): the calls its
server refuses (keys of two slots, CROSSSLOT, with the listing index on; a slot served
by another node, MOVED) fail with an error that says to use ``redis+cluster://``,
and write nothing; with the listing index off, a cluster of one node still serves
every lock; a plain server pays no extra round trip for the detection.
"""

from __future__ import annotations

import asyncio
import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from redis.cluster import key_slot

from distlocks import alock, get_backend, lock
from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockBackendUnavailable, LockError
from distlocks.testing.servers import RedisClusterSet, RedisServer

HOLDER = Holder("host", 1, "thread")
ALIAS = "cluster-node-as-server"
USER, PASSWORD = "distnode", "n0de-s3cret-pw"


@pytest.fixture(scope="module")
def one_node() -> Iterator[RedisClusterSet]:
    """A Redis Cluster of one primary (it serves every slot), with a user whose
    password the tests put in LOCATION."""
    cluster = RedisClusterSet(masters=1, replicas=0).start()
    cluster.nodes[0].client().execute_command(
        "ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all"
    )
    yield cluster
    cluster.close()


def _url(port: int) -> str:
    return f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0"


@pytest.fixture
def node_backend(one_node: RedisClusterSet, settings: Any) -> RedisBackend:
    """The alias on the one-node cluster, named as one server, listing index on."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": _url(one_node.nodes[0].port),
        },
    }
    backend = get_backend(ALIAS)
    assert isinstance(backend, RedisBackend) and backend.listing_index
    return backend


def _assert_clear(exc: BaseException, port: int) -> None:
    """The error says what to change, is both kinds the brief allows, and shows no
    credential."""
    assert isinstance(exc, LockBackendUnavailable) and isinstance(exc, ImproperlyConfigured)
    text = str(exc)
    assert f"redis+cluster://127.0.0.1:{port}" in text, text
    assert "Redis Cluster" in text, text
    assert PASSWORD not in text and PASSWORD not in repr(exc.__cause__), text
    # It keeps its type through a Celery result or a process pool.
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc) and str(copy) == text


#: Lock names: any printable text (the validation refuses control characters).
NAMES = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=30).filter(
    lambda s: s.strip() == s and bool(s)
)


@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=NAMES)
def test_lock_on_a_cluster_node_named_as_one_server_fails_clearly_and_writes_nothing(
    node_backend: RedisBackend, one_node: RedisClusterSet, name: str
) -> None:
    port = one_node.nodes[0].port
    client = one_node.nodes[0].client()
    before = client.dbsize()
    with pytest.raises(LockError) as raised:
        with lock(name, backend=ALIAS, ttl=5, timeout=0):
            pass
    _assert_clear(raised.value, port)
    assert client.dbsize() == before


def test_release_extend_and_waiting_fail_clearly(
    node_backend: RedisBackend, one_node: RedisClusterSet
) -> None:
    port = one_node.nodes[0].port
    name, owner = f"calls-{uuid.uuid4().hex}", uuid.uuid4().hex
    for call in (
        lambda: node_backend.release(name, owner),
        lambda: node_backend.extend(name, owner, 5),
        lambda: node_backend.acquire(name, owner, 5, HOLDER, wait=0.2),
    ):
        with pytest.raises(LockError) as raised:
            call()
        _assert_clear(raised.value, port)


def test_alock_fails_clearly(node_backend: RedisBackend, one_node: RedisClusterSet) -> None:
    async def take() -> None:
        async with alock(f"async-{uuid.uuid4().hex}", backend=ALIAS, ttl=5, timeout=0):
            pass

    with pytest.raises(LockError) as raised:
        asyncio.run(take())
    _assert_clear(raised.value, one_node.nodes[0].port)


def test_with_the_listing_index_off_a_one_node_cluster_still_serves_locks(
    one_node: RedisClusterSet, settings: Any
) -> None:
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": _url(one_node.nodes[0].port),
            "OPTIONS": {"listing_index": False},
        },
    }
    name = f"off-{uuid.uuid4().hex}"
    with lock(name, backend=ALIAS, ttl=5, timeout=0) as first:
        assert first.held()
    with lock(name, backend=ALIAS, ttl=5, timeout=1) as second:
        assert second.fencing_token > first.fencing_token
    backend = get_backend(ALIAS)
    assert backend.inspect(name) is None


def test_a_slot_of_another_node_fails_clearly_with_the_index_off(
    redis_cluster: RedisClusterSet, settings: Any
) -> None:
    """A node of a cluster of three named as one server answers MOVED for the slots of
    the others: the same clear error, even with the listing index off."""
    node = redis_cluster.nodes[0]
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://127.0.0.1:{node.port}/0",
            "OPTIONS": {"listing_index": False, "key_prefix": "movedtest"},
        },
    }
    backend = get_backend(ALIAS)
    mine: set[int] = set()
    for start, end, primary, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
        if int(primary[1]) == node.port:
            mine.update(range(start, end + 1))
    name = next(
        n
        for n in (f"moved-{i}" for i in range(10_000))
        if key_slot(backend.all_keys(n).lock.encode()) not in mine
    )
    with pytest.raises(LockError) as raised:
        lock(name, backend=ALIAS, ttl=5, timeout=0).acquire()
    assert isinstance(raised.value, LockBackendUnavailable)
    assert f"redis+cluster://127.0.0.1:{node.port}" in str(raised.value)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-cluster-node")).start()
    yield server
    server.stop()


def test_a_plain_server_pays_no_round_trip_per_call_for_the_detection(
    plain_server: RedisServer,
) -> None:
    """Counted, not timed: after the first call, each acquire and release is one
    EVALSHA and nothing else (no INFO, no CLUSTER)."""
    backend = RedisBackend("plain", {"LOCATION": plain_server.url})
    client = redis.Redis.from_url(plain_server.url)
    try:
        owner = uuid.uuid4().hex
        assert backend.acquire("warm", owner, 30, HOLDER).acquired
        assert backend.release("warm", owner)
        client.config_resetstat()
        for i in range(50):
            owner = uuid.uuid4().hex
            assert backend.acquire(f"cycle:{i}", owner, 30, HOLDER).acquired
            assert backend.release(f"cycle:{i}", owner)
        stats = {
            k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in client.info("commandstats").items()
        }
        assert stats.get("evalsha") == 100, stats
        assert not {k for k in stats if k.startswith(("info", "cluster"))}, stats
    finally:
        backend.close()
        client.close()


def test_with_the_index_off_renewing_leases_of_many_slots_at_once_works(
    one_node: RedisClusterSet,
) -> None:
    """The renewal thread renews the leases due together with one extend_many call,
    one script naming every lease's keys: a cluster node refuses it (two slots), so each
    lease is renewed on its own, as on a cluster, instead of all reported as failed."""
    backend = RedisBackend(
        "many",
        {"LOCATION": _url(one_node.nodes[0].port), "OPTIONS": {"listing_index": False}},
    )
    names = [f"many-{i}-{uuid.uuid4().hex}" for i in range(5)]
    owners = [uuid.uuid4().hex for _ in names]
    try:
        for name, owner in zip(names, owners, strict=True):
            assert backend.acquire(name, owner, 5, HOLDER).acquired
        leases = [(name, owner, 30.0) for name, owner in zip(names, owners, strict=True)]
        leases.append((names[0], "not-the-owner", 30.0))
        assert backend.extend_many(leases) == [True] * len(names) + [False]
        for name in names:
            info = backend.inspect(name)
            assert info is not None and info.expires_at is not None
    finally:
        for name, owner in zip(names, owners, strict=True):
            backend.release_quietly(name, owner)
        backend.close()
