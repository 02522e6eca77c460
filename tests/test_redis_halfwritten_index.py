"""The listing index's permits set is bounded without a listing.

With the listing index, a grant of a semaphore or read-write permit adds the name's
info hash to the set ``{prefix}:listing:permits``, and the release of the last permit
removes it. A permit that expires unreleased (a crashed holder, a per-call name left
to its ttl) left its member behind until someone ran a listing: a site that never
lists grew the set without bound. The grants now sweep it a few members at a time,
as they sweep the lock index (tests/test_redis_index_sweep.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks.backends.base import READ, SEMAPHORE, WRITE, Holder
from distlocks.backends.redis import RedisBackend
from tests.test_redis_halfwritten import own_prefix

pytestmark = pytest.mark.django_db(transaction=False)

HOLDER = Holder(host="test", pid=1, thread="t", extra={})
KINDS = (SEMAPHORE, READ, WRITE)


@pytest.fixture
def backend(settings: Any) -> Iterator[RedisBackend]:
    """A backend of its own key prefix on the session's server: its permits set is
    this test's alone."""
    with own_prefix(settings, "sweep") as found:
        yield found


def _members(client: redis.Redis, backend: RedisBackend) -> set[str]:
    return {m.decode() for m in client.smembers(backend.index_permits_key)}


def _abandon(backend: RedisBackend, client: redis.Redis, names: list[str], kind: str) -> None:
    """Grant a permit on each of ``names`` and let it expire unreleased."""
    for name in names:
        result = backend.permit_acquire(kind, name, uuid.uuid4().hex, 0.05, HOLDER, limit=2)
        assert result.acquired
    keys = [backend._permit_keys(kind, name)[1] for name in names]  # the info hashes
    deadline = time.monotonic() + 30
    while client.exists(*keys):  # expired on the server: nothing lives there any more
        assert time.monotonic() < deadline, "the permits did not expire"
        time.sleep(0.02)


def _grant_until_bounded(
    backend: RedisBackend, client: redis.Redis, kind: str, live: set[str]
) -> int:
    """Grant and release a permit on a name of its own until the set holds no member
    but ``live`` (those of permits still held); how many grants that took (fails
    after 5,000: the sweep reads about two members a grant)."""
    name = f"driver:{uuid.uuid4().hex[:8]}"
    for grants in range(1, 5001):
        owner = uuid.uuid4().hex
        assert backend.permit_acquire(kind, name, owner, 30, HOLDER, limit=2).acquired
        assert backend.permit_release(kind, name, owner)
        if _members(client, backend) <= live:
            return grants
    raise AssertionError(f"the permits set still holds {len(_members(client, backend) - live)} "
                         f"members of expired permits after 5,000 grants")  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_expired_permits_leave_the_set_without_a_listing(
    backend: RedisBackend, redis_client: redis.Redis, kind: str
) -> None:
    names = [f"abandoned:{i}:{uuid.uuid4().hex[:6]}" for i in range(60)]
    _abandon(backend, redis_client, names, kind)
    # Expired, and still members (only a grant, or a listing, drops them).
    assert len(_members(redis_client, backend)) > 10
    keeper = f"kept:{uuid.uuid4().hex[:6]}"
    assert backend.permit_acquire(kind, keeper, "keeper", 60, HOLDER, limit=2).acquired
    live = {backend._permit_keys(kind, keeper)[1]}
    _grant_until_bounded(backend, redis_client, kind, live)
    # The member of the permit still held stays: a listing still finds it.
    assert _members(redis_client, backend) == live
    listed = [info for info in backend.iter_locks() if info.name == keeper]
    assert [info.owner for info in listed] == ["keeper"]


@hsettings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(plan=st.lists(st.tuples(st.sampled_from(KINDS), st.booleans()), min_size=1, max_size=12))
def test_the_sweep_drops_only_members_without_a_live_permit(
    backend: RedisBackend, redis_client: redis.Redis, plan: list[tuple[str, bool]]
) -> None:
    """Permits of any kind, some left to expire and some held: the grants sweep the
    members of the expired ones away and never the member of a permit still held."""
    run = uuid.uuid4().hex[:6]
    live: set[str] = set()
    expired: list[tuple[str, str]] = []
    for index, (kind, keep) in enumerate(plan):
        name = f"p:{run}:{index}"
        if keep:
            assert backend.permit_acquire(kind, name, "holder", 60, HOLDER, limit=2).acquired
            live.add(backend._permit_keys(kind, name)[1])
        else:
            expired.append((kind, name))
    for kind, name in expired:
        _abandon(backend, redis_client, [name], kind)
    _grant_until_bounded(backend, redis_client, SEMAPHORE, live)
    assert live <= _members(redis_client, backend)
    for kind, name in [(k, f"p:{run}:{i}") for i, (k, keep) in enumerate(plan) if keep]:
        assert backend.permit_release(kind, name, "holder")
