"""Review 8 of the ZooKeeper tokens (the fence node's version): an upgrade from the
release whose tokens were zxids, on a real server.

The release before issued, for a grant that wrote the fence node with zxid ``z``,
``ctime * 1000 + (z - czxid)``: the zxid counts every transaction of the ensemble (other
names' grants too), so a name's old tokens are far above ``ctime * 1000 + version``,
with the same ctime (the fence node stays). Rows a FencedModel wrote under the old
tokens would refuse every write of the upgraded release for ever. The old release's
grants are replayed here with a raw kazoo client, as its code made them (a multi-op:
create the contender node, write the fence node)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from kazoo.client import KazooClient

from distlocks import get_backend, lock, rwlock
from distlocks.testing.zookeeper_server import ZooKeeperServer, zookeeper_missing

pytestmark = pytest.mark.skipif(bool(zookeeper_missing()), reason=zookeeper_missing())

BACKEND = "distlocks.backends.zookeeper.ZooKeeperBackend"
ALIAS = "zkup"


@pytest.fixture(scope="module")
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def raw(zk_server: ZooKeeperServer) -> Iterator[KazooClient]:
    client = KazooClient(hosts=zk_server.location, timeout=10)
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


def old_grant(client: KazooClient, parent: str, node: str, *, keep: bool = False) -> int:
    """One grant as the release before made it; its token by that release's rule. The
    holder's node is deleted (released) unless ``keep``."""
    client.ensure_path(parent)
    txn = client.transaction()
    txn.create(f"{parent}/{node}", b"{}", ephemeral=True, sequence=True)
    txn.set_data(parent, b"")
    created, fence = txn.commit()
    if not keep:
        client.delete(created)
    return int(fence.ctime) * 1000 + (int(fence.mzxid) - int(fence.czxid))


def other_traffic(client: KazooClient, count: int) -> None:
    """Transactions of other names: they move the zxid, not this name's version."""
    path = f"/review8-other/{uuid.uuid4().hex}"
    client.ensure_path(path)
    for _ in range(count):
        client.set(path, b"x")


@hypothesis.settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["lock", "write"]),
    history=st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=4),
    new_grants=st.integers(min_value=1, max_value=3),
    evict=st.booleans(),
)
def test_the_first_grants_after_an_upgrade_are_above_the_old_zxid_tokens(
    settings: Any,
    zk_server: ZooKeeperServer,
    raw: KazooClient,
    kind: str,
    history: list[int],
    new_grants: int,
    evict: bool,
) -> None:
    """Old grants of one name, each after some other names' transactions (with
    ``evict``, the last one's holder still there, forced out by the upgraded release);
    then the upgraded release: its counter is at least the last old token, and every
    new grant is above every old token and above the grant before it."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {"BACKEND": BACKEND, "LOCATION": zk_server.location,
                "OPTIONS": {"session_timeout": 10}},
    }  # fmt: skip
    backend = get_backend(ALIAS)
    name = f"review8:upgrade:{uuid.uuid4().hex[:8]}"
    if kind == "lock":
        parent, node = backend.lock_path(name), "c-old-"
    else:
        parent, node = backend.permit_dir("write", name), "write-old-"
    old = []
    for index, others in enumerate(history):
        other_traffic(raw, others)
        old.append(old_grant(raw, parent, node, keep=evict and index == len(history) - 1))
    counter = backend.fencing_counter if kind == "lock" else backend.permit_counter
    assert counter(name) >= max(old), "the counter is below the tokens issued"
    if evict:
        if kind == "lock":
            assert backend.force_release(name)
        else:
            assert backend.permit_force_release("write", name) == 1
        assert counter(name) > max(old), "the eviction did not move the counter on"
    tokens = []
    for _ in range(new_grants):
        other_traffic(raw, 3)
        if kind == "lock":
            with lock(name, backend=ALIAS, ttl=10, timeout=10, auto_renew=False) as lease:
                tokens.append(lease.fencing_token)
        else:
            with rwlock(name, backend=ALIAS).write(ttl=10, timeout=10) as lease:
                tokens.append(lease.fencing_token)
        assert counter(name) >= tokens[-1]
    assert tokens[0] > max(old), (tokens, old)
    assert tokens == sorted(set(tokens)), tokens


@pytest.mark.parametrize("data", [b"", b"not a base", b'{"base": -5}', b"[1]", b"\xff\xfe"])
@pytest.mark.parametrize("kind", ["lock", "write"])
def test_a_fence_node_written_by_hand_is_taken_over_not_spun_on(
    settings: Any, zk_server: ZooKeeperServer, raw: KazooClient, data: bytes, kind: str
) -> None:
    """Whatever a fence node's data was made by hand (or by a release before), the next
    grant takes it over with one write and gets a token above every one issued: no
    acquire spins on it, and the counter never goes back."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {"BACKEND": BACKEND, "LOCATION": zk_server.location,
                "OPTIONS": {"session_timeout": 10}},
    }  # fmt: skip
    backend = get_backend(ALIAS)
    name = f"review8:byhand:{uuid.uuid4().hex[:8]}"
    counter = backend.fencing_counter if kind == "lock" else backend.permit_counter

    def grant() -> int:
        if kind == "lock":
            with lock(name, backend=ALIAS, ttl=10, timeout=10, auto_renew=False) as lease:
                return lease.fencing_token
        with rwlock(name, backend=ALIAS).write(ttl=10, timeout=10, auto_renew=False) as lease:
            return lease.fencing_token

    tokens = [grant(), grant()]
    path = backend.lock_path(name) if kind == "lock" else backend.permit_dir("write", name)
    raw.set(path, data)
    seen = counter(name)
    assert seen >= tokens[-1]
    tokens += [grant(), grant()]
    assert tokens == sorted(set(tokens)), tokens
    assert tokens[2] > seen
    assert counter(name) == tokens[-1]
