"""One lease of the renewer's batch whose key holds a value of another type.

The renewer renews up to 500 leases per script (extend_many). A key of the wrong type
under one of them (something other than distlocks wrote it) failed the whole script:
the leases renewed before it in the batch were renewed while the caller was told
they were not, and every other lease of the batch was told its renewal failed. Each
lease now has its own outcome: the bad one a LockError naming its key, the others
renewed (True) or not held (False), as if it were not in the batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from distlocks.backends.base import Holder
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import LockError
from tests.test_redis_halfwritten import own_prefix

pytestmark = pytest.mark.django_db(transaction=False)

HOLDER = Holder(host="test", pid=1, thread="t", extra={})


@pytest.fixture(params=[False, True], ids=["plain", "listed"])
def backend(settings: Any, request: pytest.FixtureRequest) -> Iterator[RedisBackend]:
    with own_prefix(settings, "batch", listing_index=request.param) as found:
        yield found


@hsettings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    held=st.lists(st.booleans(), min_size=2, max_size=8),
    data=st.data(),
)
def test_a_bad_key_fails_only_its_own_lease(
    backend: RedisBackend, redis_client: redis.Redis, held: list[bool], data: st.DataObject
) -> None:
    names = [f"batch:{uuid.uuid4().hex[:10]}" for _ in held]
    for name, is_held in zip(names, held, strict=True):
        if is_held:
            assert backend.acquire(name, "me", 30, HOLDER).acquired
    bad = data.draw(st.integers(0, len(names) - 1), label="bad")
    role = data.draw(st.sampled_from(["lock", "fence"]), label="role")
    key = getattr(backend.all_keys(names[bad]), role)
    redis_client.delete(key)
    redis_client.rpush(key, "someone else")
    try:
        outcomes = backend.extend_many([(name, "me", 300) for name in names])
        assert len(outcomes) == len(names)
        for i, (name, is_held, outcome) in enumerate(zip(names, held, outcomes, strict=True)):
            if i == bad:
                if outcome is False and not held[i] and role == "fence":
                    continue  # not held: nothing to renew, nothing written
                assert isinstance(outcome, LockError), outcome
                assert key in str(outcome) and "delete" in str(outcome).lower(), outcome
                continue
            assert outcome is is_held, (i, outcome)
            pttl = redis_client.pttl(backend.all_keys(name).lock)
            if is_held:
                assert pttl > 60_000, "told renewed, but it was not"
    finally:
        redis_client.delete(key)
        for name in names:
            backend.release(name, "me")
