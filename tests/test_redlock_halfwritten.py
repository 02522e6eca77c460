"""A key of the wrong type on a Redlock master leaves every key of the call as it was.

The single-node scripts run each command that can fail before their first write
(tests/test_redis_halfwritten.py, tests/test_review6_redis_everykey.py). Redlock's own
scripts do too: the owner's takeover of its entry by a newer attempt (which also drops
the owner's wait registrations) and the renewer's batch, EXTEND_MANY, which answers a
lease whose keys hold another type on its own (-1) instead of failing the whole batch
after the leases before it were renewed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.test import override_settings

from distlocks import get_backend
from distlocks.backends.base import Holder
from distlocks.backends.redlock import RedlockBackend
from distlocks.backends.redlock.attempts import _next_attempt
from distlocks.exceptions import LockError
from tests.test_redis_halfwritten import TYPES, _write

pytestmark = pytest.mark.django_db(transaction=False)

HOLDER = Holder(host="test", pid=1, thread="t", extra={})


@pytest.fixture
def backend(settings: Any) -> Iterator[RedlockBackend]:
    alias = f"rlhalf-{uuid.uuid4().hex[:8]}"
    config = {"BACKEND": "distlocks.backends.redlock.RedlockBackend",
              "LOCATION": settings.REDLOCK_URLS, "OPTIONS": {"key_prefix": alias}}  # fmt: skip
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, alias: config}):
        found = get_backend(alias)
        assert isinstance(found, RedlockBackend)
        try:
            yield found
        finally:
            found.close()


def _snapshot(client: redis.Redis, prefix: str, skip: str) -> dict[bytes, Any]:
    keys = sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
    return {k: client.dump(k) for k in keys if k != skip.encode()}


@pytest.mark.parametrize("role", ["fence", "waiters", "queue"])
@pytest.mark.parametrize("kind", TYPES)
def test_a_takeover_by_a_newer_attempt_writes_nothing_on_a_wrong_type(
    backend: RedlockBackend, role: str, kind: str
) -> None:
    master = backend.masters[0]
    client = master.client
    name = f"rlhalf:{uuid.uuid4().hex[:10]}"
    keys, args = master._acquire_call(name, "me", 30, HOLDER, 5.0, True)
    first = backend._script(0, "acquire")
    assert first(keys=keys, args=[*args, _next_attempt()], client=client)[0] == 1
    # The owner registered as a waiter too (an earlier attempt of its acquisition):
    # the takeover drops those registrations.
    client.zadd(master.all_keys(name).waiters, {"me": 2**40})
    client.zadd(master.all_keys(name).queue, {"me": 1})
    key = str(getattr(master.all_keys(name), role))
    if client.type(key).decode() == kind:
        pytest.skip("the key holds that type already")
    _write(client, key, kind)
    before = _snapshot(client, master.key_prefix, key)
    try:
        reply = first(keys=keys, args=[*args, _next_attempt()], client=client)
    except redis.ResponseError:
        after = _snapshot(client, master.key_prefix, key)
        assert after == before, "a failed takeover wrote some keys"
    else:
        assert reply[0] == 1  # a type the script never reads there: taken over


@pytest.mark.parametrize("role", ["lock", "fence"])
@pytest.mark.parametrize("kind", TYPES)
def test_a_batch_renewal_answers_a_wrong_type_on_its_own(
    backend: RedlockBackend, role: str, kind: str
) -> None:
    """The first lease of the batch is broken on every master: the second is renewed,
    the first reported, and nothing of the first was written."""
    broken, fine = (f"rlhalf:{uuid.uuid4().hex[:10]}" for _ in range(2))
    for name in (broken, fine):
        assert backend.acquire(name, "me", 30, HOLDER).acquired
    before = {}
    for master in backend.masters:
        key = str(getattr(master.all_keys(broken), role))
        if master.client.type(key).decode() == kind:
            pytest.skip("the key holds that type already")
        _write(master.client, key, kind)
        before[master.alias] = (key, _snapshot(master.client, master.key_prefix, key))
    pttl = backend.masters[0].client.pttl(backend.masters[0].all_keys(fine).lock)
    results = backend.extend_many([(broken, "me", 300), (fine, "me", 300)])
    assert results[1] is True
    assert results[0] is False or isinstance(results[0], LockError), results
    for master in backend.masters:
        key, snapshot = before[master.alias]
        after = _snapshot(master.client, master.key_prefix, key)
        # The fine lease was renewed: compare the broken lease's keys only.
        keys = {k for k in snapshot if broken.encode() in k}
        assert {k: after.get(k) for k in keys} == {k: snapshot[k] for k in keys}
    assert backend.masters[0].client.pttl(backend.masters[0].all_keys(fine).lock) > pttl
