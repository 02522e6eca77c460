"""Review 29: what the Redis backend leaves on the server after many lock and permit
cycles, and the release ids of a forked child (a real server, no mocks)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from distlocks.backends.redis.lock import _pid, _release_ids

HOLDER = Holder("host", 1, "thread")


@pytest.fixture(scope="module")
def backend() -> Iterator[RedisBackend]:
    prefix = f"r29-{uuid.uuid4().hex[:8]}"
    made = RedisBackend(
        "r29", {"LOCATION": django_settings.REDIS_URL, "OPTIONS": {"key_prefix": prefix}}
    )
    yield made
    keys = list(made.client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        made.client.delete(*keys)
    made.close()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kinds=st.lists(st.sampled_from([SEMAPHORE, READ, WRITE]), min_size=1, max_size=12),
    holders=st.integers(min_value=1, max_value=3),
)
def test_released_permits_leave_nothing_in_the_listing_index(
    backend: RedisBackend, kinds: list[str], holders: int
) -> None:
    """Semaphores and read-write locks of per-call names, each taken and given back:
    once every permit is released, the listing's set of permit names holds none of
    them (it grew by one member per name for ever, until a listing ran)."""
    names = []
    for kind in kinds:
        name = f"p-{uuid.uuid4().hex}"
        names.append(name)
        owners = [f"o{i}" for i in range(1 if kind == WRITE else holders)]
        for owner in owners:
            assert backend.permit_acquire(kind, name, owner, 30, HOLDER, limit=3).acquired
        for owner in owners:
            assert backend.permit_release(kind, name, owner) is True
    members = {m.decode() for m in backend.client.smembers(backend.index_permits_key)}
    left = [m for m in members if any(n in m for n in names)]
    assert left == []


def test_a_forked_childs_release_ids_differ_from_its_parents(backend: RedisBackend) -> None:
    """The ids are pid + a counter the child inherits: the pid part keeps them apart."""
    parent = {f"{_pid()}.{next(_release_ids)}" for _ in range(3)}
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        ids = ",".join(f"{_pid()}.{next(_release_ids)}" for _ in range(3))
        os.write(write, ids.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    got = set(os.read(read, 4096).decode().split(","))
    os.close(read)
    assert status == 0 and len(got) == 3
    assert not got & parent


@pytest.mark.parametrize("kind", [SEMAPHORE, READ, WRITE])
@pytest.mark.parametrize("by_owner", [True, False])
def test_force_released_permits_leave_nothing_in_the_listing_index(
    backend: RedisBackend, kind: str, by_owner: bool
) -> None:
    """A force release that evicts the last permit of a name takes the name out of the
    listing's set too, as a release does (every permit, or the one owner's)."""
    name = f"f-{uuid.uuid4().hex}"
    assert backend.permit_acquire(kind, name, "o", 30, HOLDER, limit=2).acquired
    assert backend.permit_force_release(kind, name, "o" if by_owner else None) == 1
    members = {m.decode() for m in backend.client.smembers(backend.index_permits_key)}
    assert [m for m in members if name in m] == []
